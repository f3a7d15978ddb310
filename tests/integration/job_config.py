"""The typed configuration of one integration job (tests/integration/job.py), checked before the job starts.

A key that is not a field (a typo, a renamed knob) is refused with its name, never silently replaced by a
default. Fields that configure ``SlideDPStrategy`` carry the strategy's own argument names and defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.library_models import NAMES as LIBRARY_NAMES

# the fields passed to SlideDPStrategy under their own names
STRATEGY_OPTIONS = (
    "param_route",
    "grad_route",
    "chunk_bytes",
    "prefetch_window",
    "max_units_in_flight",
    "update_threads",
    "activation_policy",
    "update",
    "meta_init",
    "host_layout",
    "checkpoint_format",
    "optimizer_state",
    "bf16_copy",
)
# former job keys, named in the error so that an old call site finds its new name
RENAMED = {"window": "prefetch_window", "activations": "activation_policy"}
CHOICES = {
    "strategy": ("slidedp", "ddp", "single"),
    "arch": ("dense", "moe"),
    "kill_in": ("forward", "backward", "update"),
    "library": (None, *LIBRARY_NAMES),
}
# a variant changes the knobs of one fit; it cannot hold variants or move the job's output folder
NOT_IN_VARIANTS = ("variants", "out")


@dataclass(frozen=True)
class JobConfig:
    """One job: a model, its data, the Trainer and its strategy, what to write, and which failure to inject."""

    out: str  # output folder: losses, final weights, ledger and done markers per rank
    strategy: str  # "slidedp", or a reference: "ddp" / "single" (DDPStrategy on several devices, "auto" on one)
    devices: int
    steps: int  # Trainer max_steps
    batch: int  # per-rank batch size
    tied: bool  # the dense model ties its head to the embedding
    # model
    arch: str = "dense"  # "dense" (tests.helpers.tiny_config) or "moe" (tiny_moe_config)
    model: str | None = None  # a transformers model_type: tests.helpers.family_config's tiny model (instead of arch)
    library: str | None = None  # a model of another library by name: tests/integration/library_models.py (instead)
    layers: int = 2
    vocab: int = 96  # the model's vocabulary (the data's tokens): 2048 makes the embedding an outlier unit
    init_seed: int = 1234
    init_from: str | None = None  # a LightningModule state dict to start from
    pretrained: str | None = None  # a save_pretrained directory, loaded with slidedp_lightning.from_pretrained
    loss_chunk: int | None = None  # use_chunked_loss with this chunk
    freeze: list[str] | None = None  # parameter-name prefixes (of the transformers model) set requires_grad=False
    # data
    num_nodes: int = 1
    data_batches: int | None = None  # batches of data per rank (default: steps)
    constant_data: bool = False  # every sample the same: batch order and sharding cannot matter
    drop_batch: int | None = None  # this batch leaves the data; later ones move up (needs distributed_sampler off)
    distributed_sampler: bool = True
    # optimizer
    lr: float = 3e-3
    constant_lr: bool = False  # no warm-up / decay schedule
    # Trainer
    accelerator: str = "cpu"
    precision: str = "32-true"
    clip: float | None = None  # gradient_clip_val
    clip_algorithm: str = "norm"
    accumulate: int = 1  # accumulate_grad_batches
    ckpt_path: str | None = None  # resume from this checkpoint
    pg_timeout: float = 60  # process-group timeout, seconds
    # SlideDPStrategy (STRATEGY_OPTIONS, the strategy's defaults)
    param_route: str = "full"
    grad_route: str = "gpu_reduce"
    chunk_bytes: int | str | None = None
    prefetch_window: int = 2
    max_units_in_flight: int = 2
    update_threads: int | None = None
    activation_policy: str | None = None
    update: str = "auto"
    meta_init: bool = False
    host_layout: str = "replicated"
    checkpoint_format: str = "distributed"
    optimizer_state: str = "fp32"
    bf16_copy: bool = True
    state_on_disk: bool = False  # optimizer_state becomes StateOnDisk(out/state, moments=optimizer_state)
    master_on_disk: bool = False  # with state_on_disk: StateOnDisk(..., master=True)
    memory_budget: int | None = None  # activation_policy becomes AutoPolicy(memory_budget=...)
    # outputs
    trace_dir: str | None = None  # a LaneTrace callback writes here (slidedp only)
    dump_initial: bool = False  # rank 0 saves the engine's initial state as initial_state.pt
    record_memory: bool = False  # each rank writes its peak RssAnon from fit's start to on_train_start (memory_rank*)
    save_at: int | None = None  # save a checkpoint after this optimizer step
    save_path: str | None = None  # where (default: out/ck)
    # fault injection
    raise_at_step: int = -1
    kill_at_step: int = -1
    kill_rank: int = 1
    kill_in: str = "forward"
    kill_in_save: int | None = None  # this rank SIGKILLs itself inside the save at save_at
    slow_writes_rank: int | None = None  # this rank's state-file writes each take 0.3 s longer (a slow disk)
    nan_at_step: int = -1
    nan_rank: int = 0
    # one fit per variant in the same processes: {name: knobs}, outputs under out/<name>
    variants: dict[str, dict[str, Any]] | None = None
    keep_going: bool = False  # a failed variant writes error.txt and the next one runs

    def __post_init__(self) -> None:
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"job config {key}={getattr(self, key)!r}: expected one of {allowed}")
        for name, knobs in (self.variants or {}).items():
            check_keys(knobs, f"variant {name!r}", exclude=NOT_IN_VARIANTS)
            self.variant(name)  # the merged configuration passes the same checks

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> JobConfig:
        """A configuration from keyword values; unknown or missing keys raise ``ValueError`` naming them."""
        check_keys(values)
        missing = [f.name for f in dataclasses.fields(cls) if _required(f) and f.name not in values]
        if missing:
            raise ValueError(f"job config: missing key(s) {missing}")
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> JobConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def variant(self, name: str) -> JobConfig:
        """The fit of variant ``name``: this configuration with its knobs, writing to ``out/<name>``."""
        knobs = (self.variants or {})[name]
        return dataclasses.replace(self, **knobs, variants=None, out=os.path.join(self.out, name))

    def strategy_options(self) -> dict[str, Any]:
        """The ``SlideDPStrategy`` keyword arguments this job sets (every one of STRATEGY_OPTIONS)."""
        return {name: getattr(self, name) for name in STRATEGY_OPTIONS}


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


FIELDS = frozenset(f.name for f in dataclasses.fields(JobConfig))


def check_keys(values: Mapping[str, Any], where: str = "job config", exclude: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming every key of ``values`` that is not a JobConfig field (or is in ``exclude``),
    with the field it was probably meant to be; a ``variants`` mapping's knobs are checked as well."""
    known = FIELDS - set(exclude)
    unknown = [key for key in values if key not in known]
    if unknown:
        hints = []
        for key in unknown:
            guess = RENAMED.get(key) or next(iter(difflib.get_close_matches(key, sorted(known), n=1)), None)
            hints.append(f"{key!r}" + (f" (did you mean {guess!r}?)" if guess else ""))
        raise ValueError(f"{where}: unknown key(s) {', '.join(hints)}")
    variants = values.get("variants")
    if isinstance(variants, Mapping):
        for name, knobs in variants.items():
            check_keys(knobs, f"variant {name!r}", exclude=NOT_IN_VARIANTS)
