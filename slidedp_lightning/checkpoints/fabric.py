"""``fabric.save`` / ``fabric.load`` under :class:`~slidedp_lightning.fabric.SlideDPFabricStrategy`, which it
reads through :class:`FabricStrategyView` (the adapter imports this module, never the reverse).

``checkpoint_format="distributed"``: a directory that every rank writes (:mod:`.distributed`: the ledger's weights,
moments and step count), the rest of Fabric's ``state`` stored beside it as JSON and tensors; ``"full"``: one file
from rank 0 holding the state dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.optim import Optimizer

from slidedp_lightning.checkpoints import distributed as sharded
from slidedp_lightning.checkpoints.full import save_full

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO

    from slidedp_lightning.options import SlideDPOptions
    from slidedp_lightning.runtime.engine import SlideDPEngine


class _LossScalingState(Protocol):
    @property
    def scales_loss(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class FabricStrategyView(Protocol):
    """What ``fabric.save`` / ``fabric.load`` read of the Fabric strategy."""

    @property
    def engine(self) -> SlideDPEngine | None: ...

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def optimizer(self) -> Optimizer | None: ...

    @property
    def options(self) -> SlideDPOptions: ...

    @property
    def precision(self) -> _LossScalingState: ...

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    @property
    def is_global_zero(self) -> bool: ...

    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None: ...

    def _convert_stateful_objects_in_state(
        self, state: dict[str, Any], filter: dict[str, Callable[[str, Any], bool]]
    ) -> dict[str, Any]: ...


ENTRY = "slidedp_fabric"  # a distributed checkpoint's record of which state entries the ledger holds
PRECISION = "slidedp_precision"  # a full checkpoint's loss-scaling state (16-mixed)


def entries(strategy: FabricStrategyView, state: dict[str, Any]) -> tuple[str | None, str | None]:
    """The keys of ``state`` that hold the model and the optimizer set up; refuses any other module or
    optimizer (their state would not be SlideDP's)."""
    model_key = next((k for k, v in state.items() if v is strategy.model and v is not None), None)
    opt_key = next((k for k, v in state.items() if v is strategy.optimizer and v is not None), None)
    others = [k for k, v in state.items() if isinstance(v, (nn.Module, Optimizer)) and k not in (model_key, opt_key)]
    if others:
        raise ValueError(
            f"SlideDP: state entries {others} are a module or optimizer other than the model and optimizer set "
            "up with this strategy; their state is not in the ledger. Save them separately."
        )
    return model_key, opt_key


def save(
    strategy: FabricStrategyView,
    path: _PATH,
    state: dict[str, Any],
    storage_options: Any | None = None,
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
) -> None:
    """``fabric.save``: with ``checkpoint_format="distributed"`` a directory that every rank writes (the ledger:
    weights, moments and step count), the rest of ``state`` stored beside it as JSON and tensors; with
    ``"full"`` one file from rank 0 holding the state dicts."""
    model_key, opt_key = entries(strategy, state)
    if filter and {model_key, opt_key} & set(filter):
        raise ValueError(
            "SlideDP checkpoints hold the whole ledger; a filter on the model or optimizer entry is not applied: "
            "drop it (export a subset with slidedp_lightning.export)."
        )
    if strategy.options.checkpoint_format == "full":
        converted = strategy._convert_stateful_objects_in_state(state, filter=filter or {})
        if strategy.precision.scales_loss:
            converted[PRECISION] = strategy.precision.state_dict()
        if strategy.is_global_zero:
            save_full(strategy.checkpoint_io, converted, path, storage_options)
        return None
    sharded.refuse_storage_options(storage_options)
    rest = {k: v for k, v in state.items() if k not in (model_key, opt_key)}
    extra = strategy._convert_stateful_objects_in_state(rest, filter=filter or {})
    if opt_key is not None:  # the moments go with the ledger; keep the hyper-parameters
        extra[opt_key] = {"state": {}, "param_groups": state[opt_key].state_dict()["param_groups"]}
    record = {"model": model_key, "optimizer": opt_key, "precision": strategy.precision.state_dict()}
    if strategy.engine is None:
        raise RuntimeError(
            "SlideDP: fabric.save writes the ledger made by fabric.setup(model, optimizer): set the model up first."
        )
    sharded.save(strategy.engine, {"fabric": extra, ENTRY: record}, path)
    return None


def load(
    strategy: FabricStrategyView,
    path: _PATH,
    state: nn.Module | Optimizer | dict[str, Any] | None = None,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """``fabric.load``: a distributed checkpoint is read into the ledger (bit-exact: weights, moments, step
    count, loss scale); the rest of it restores ``state``'s other entries; what ``state`` does not ask for is
    returned. A full checkpoint (file) is loaded with ``weights_only=True`` unless told otherwise."""
    if not sharded.is_sharded(path):
        return _load_full(strategy, path, state, strict, True if weights_only is None else weights_only)
    if not state:
        return dict(sharded.read_meta(path).get("fabric", {}))
    if not isinstance(state, dict) or strategy.engine is None:
        raise ValueError(
            f"{path} is a SlideDP distributed checkpoint: set up the model (and optimizer) with Fabric first, "
            "then fabric.load(path, {'model': model, 'optimizer': optimizer, ...}) reads it into the ledger."
        )
    model_key, opt_key = entries(strategy, state)
    if model_key is None:
        raise ValueError(
            "SlideDP: a distributed checkpoint's weights and Adam moments are read together into the ledger: "
            "pass the model set up with Fabric in fabric.load's state."
        )
    meta = sharded.read_meta(path)
    if ENTRY not in meta:
        raise ValueError(f"{path} was not written by fabric.save (a Trainer checkpoint?): load it with the Trainer.")
    record, checkpoint = meta[ENTRY], dict(meta.get("fabric", {}))
    saved = {k for k in (record["model"], record["optimizer"]) if k is not None}
    _validate_keys_for_strict_loading(state.keys(), set(checkpoint) | saved, strict=strict)
    if model_key != record["model"] or (opt_key is not None and opt_key != record["optimizer"]):
        raise KeyError(
            f"SlideDP: the checkpoint holds the model under {record['model']!r} and the optimizer under "
            f"{record['optimizer']!r}; fabric.load's state has them under {model_key!r} and {opt_key!r}."
        )
    sharded.load(strategy.engine, path)  # every rank: weights, moments and step count into the ledger
    strategy.precision.load_state_dict(record.get("precision") or {})
    if opt_key is not None and opt_key in checkpoint:  # moments and step are in the ledger: the hyper-parameters
        for group, saved_group in zip(state[opt_key].param_groups, checkpoint.pop(opt_key)["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
    _restore_rest(state, checkpoint, skip=(model_key, opt_key))
    return checkpoint


def _load_full(
    strategy: FabricStrategyView, path: _PATH, state: Any, strict: bool, weights_only: bool
) -> dict[str, Any]:
    checkpoint = strategy.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    if isinstance(state, nn.Module):  # fabric.load_raw
        strategy.load_module_state_dict(state, checkpoint, strict)
        return {}
    if isinstance(state, Optimizer):
        _load_optimizer(strategy, state, checkpoint)
        return {}
    model_key, opt_key = entries(strategy, state)
    strategy.precision.load_state_dict(checkpoint.pop(PRECISION, None) or {})
    _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
    if model_key is not None and model_key in checkpoint:
        strategy.load_module_state_dict(state[model_key], checkpoint.pop(model_key), strict)
    if opt_key is not None and opt_key in checkpoint:
        _load_optimizer(strategy, state[opt_key], checkpoint.pop(opt_key))
    _restore_rest(state, checkpoint, skip=(model_key, opt_key))
    return checkpoint


def _load_optimizer(strategy: FabricStrategyView, optimizer: Optimizer, saved: dict[str, Any]) -> None:
    if strategy.engine is not None and optimizer is strategy.optimizer:
        strategy.engine.load_optimizer_state_dict(optimizer, saved)
    else:
        optimizer.load_state_dict(saved)


def _restore_rest(state: dict[str, Any], checkpoint: dict[str, Any], skip: tuple[str | None, ...]) -> None:
    """As Fabric does: a stateful entry loads its part in place, any other is replaced by it."""
    for name, obj in list(state.items()):
        if name in skip or name not in checkpoint:
            continue
        if isinstance(obj, _Stateful):
            obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
