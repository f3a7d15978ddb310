"""The ledger as named tensors: state dicts, optimizer state, checkpoint and export views.

:class:`LedgerState` maps the root module's state-dict names to ledger slots and reads or writes the FP32
master and both moments there. It never synchronizes by itself: the engine waits for every update before
calling a reader and evicts every resident unit before calling a writer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from cpu_ops.adamw8 import QUANT_BLOCK, dequantize_blockwise, quantize_blockwise
from slidedp_lightning.runtime.layout import Layout
from slidedp_lightning.runtime.ledger.geometry import MOMENTS
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.topology import Topology

Slot = tuple[int, int]  # (unit index, slot index) of one parameter in the layout


class UnsupportedLayoutError(RuntimeError):
    """An operation that needs whole parameters on a host, asked of host-sharded ledgers."""


class LedgerState:
    """Named views of one host's ledger (parameters keyed as ``root.state_dict()``, tied ones once)."""

    def __init__(
        self,
        root: nn.Module,
        layout: Layout,
        ledger: HostLedger,
        topology: Topology,
        slot_of: dict[int, Slot],
        host_ranges: list[tuple[int, int]] | None,
    ) -> None:
        self.root, self.layout, self.ledger, self.topology = root, layout, ledger, topology
        self._slot_of = slot_of  # id(parameter) -> its slot
        self._host_ranges = host_ranges
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (FP32 scratch, BF16 view) to write back

    def require_whole_parameters(self, what: str) -> None:
        if self.topology.host_sharded:
            raise UnsupportedLayoutError(
                f"{what} reads whole parameters, and with host-sharded ledgers each host holds 1/N of them. Save "
                "distributed checkpoints (checkpoint_format='distributed', the default): they resume with either "
                "host layout, and `python -m slidedp_lightning.export CHECKPOINT OUT` exports one offline."
            )

    def require_moments_in_memory(self, what: str) -> None:
        """Refuse ``what`` (reading or writing whole moments) while they live in the state file on disk."""
        if self.ledger.geometry.on_disk:
            raise UnsupportedLayoutError(
                f"{what} gathers the Adam moments in memory, and this run keeps them in a state file on disk "
                f"({self.ledger.disk.directory if self.ledger.disk else 'StateOnDisk'}): save distributed "
                "checkpoints (checkpoint_format='distributed', the default), which read and write the state "
                "file in place. The weights export as usual."
            )

    # -- reading ------------------------------------------------------------------------------------------
    def slot_of(self, tensor: torch.Tensor) -> Slot | None:
        """The ledger slot of a parameter of the streamed model (None for buffers and other tensors)."""
        return self._slot_of.get(id(tensor))

    def _covered(self, where: Slot, region: str) -> bool:
        """Whether the parameter's unit range in ``region`` holds it (not a frozen parameter left out of it)."""
        return self.layout.units[where[0]].slots[where[1]].end <= self.ledger.extent(region, where[0])

    def _view(self, where: Slot, region: str) -> torch.Tensor | None:
        """The parameter's elements in ``region`` (None when the region does not hold them: a wholly frozen unit, or
        a frozen parameter beside trainable ones, keeps no moments, nor a master where the device reads BF16)."""
        slot = self.layout.units[where[0]].slots[where[1]]
        flat = self.ledger.region(region, where[0])
        return (
            None if flat is None or not self._covered(where, region) else flat[slot.offset : slot.end].view(slot.shape)
        )

    def _master_on_disk(self, where: Slot) -> bool:
        """Whether the parameter's FP32 master lies in the state file on disk (not a frozen one without a master)."""
        return self.ledger.master_on_disk and self._covered(where, "master")

    def master_view(self, unit_index: int, slot_index: int) -> torch.Tensor:
        """The parameter's FP32 weights: a view of the master, or (a frozen parameter under bf16 compute, which
        keeps only its BF16 copy) an FP32 copy of its BF16 copy, or (a master on disk) a copy read from the file."""
        view = self._view((unit_index, slot_index), "master")
        if view is None and self._master_on_disk((unit_index, slot_index)):
            assert self.ledger.disk is not None
            slot = self.layout.units[unit_index].slots[slot_index]
            out = torch.empty(slot.numel)
            self.ledger.disk.read_range("master", unit_index, slot.offset, out)
            return out.view(slot.shape)
        if view is None:
            bf16 = self._view((unit_index, slot_index), "bf16")
            assert bf16 is not None, "every unit keeps its master or its BF16 copy"
            return bf16.float()
        return view

    @property
    def int8(self) -> bool:
        return self.ledger.geometry.optimizer_state == "int8"

    def moments(self, unit_index: int, slot_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The parameter's Adam moments in FP32: views of the ledger, or with int8 moments dequantized copies;
        None for a frozen parameter (it keeps none)."""
        self.require_moments_in_memory("reading a parameter's moments")
        where = (unit_index, slot_index)
        if self.int8:
            if not self._covered(where, "exp_avg"):
                return None
            return self._dequantized(where, "exp_avg"), self._dequantized(where, "exp_avg_sq")
        m, v = self._view(where, "exp_avg"), self._view(where, "exp_avg_sq")
        return None if m is None or v is None else (m, v)

    def _blocks(self, where: Slot, region: str) -> tuple[int, np.ndarray, np.ndarray]:
        """(first element, codes, scales) of the whole blocks of ``region`` that hold the parameter ``where``."""
        slot = self.layout.units[where[0]].slots[where[1]]
        b0, b1 = slot.offset // QUANT_BLOCK, -(-slot.end // QUANT_BLOCK)
        codes, scales = self.ledger.region_np(region, where[0]), self.ledger.region_np(f"{region}_absmax", where[0])
        assert codes is not None and scales is not None
        return b0 * QUANT_BLOCK, codes[b0 * QUANT_BLOCK : b1 * QUANT_BLOCK], scales[b0:b1]

    def _dequantized(self, where: Slot, region: str) -> torch.Tensor:
        slot = self.layout.units[where[0]].slots[where[1]]
        start, codes, scales = self._blocks(where, region)
        values = dequantize_blockwise(codes, scales, signed=region == "exp_avg")
        return torch.from_numpy(values[slot.offset - start : slot.end - start]).view(slot.shape)

    def _quantize_into(self, where: Slot, region: str, value: torch.Tensor) -> None:
        """Write FP32 ``value`` into the parameter's int8 moment: its blocks are dequantized, overwritten where the
        parameter lies, and quantized again (a neighbour sharing a block is requantized with the block's scale)."""
        slot = self.layout.units[where[0]].slots[where[1]]
        start, codes, scales = self._blocks(where, region)
        signed = region == "exp_avg"
        values = dequantize_blockwise(codes, scales, signed=signed)
        values[slot.offset - start : slot.end - start] = value.detach().reshape(-1).to(torch.float32).numpy()
        codes[:], scales[:] = quantize_blockwise(values, signed=signed)

    def named_slots(self) -> dict[str, Slot]:
        """Each ledger parameter once (a tied one under its first name), keyed as ``root.state_dict()``."""
        out: dict[str, Slot] = {}
        seen: set[Slot] = set()
        for name, t in self.root.state_dict(keep_vars=True).items():
            where = self._slot_of.get(id(t))
            if where is not None and where not in seen:
                seen.add(where)
                out[name] = where
        return out

    def ledger_tensors(self, names: list[str], writing: bool = False) -> dict[str, torch.Tensor]:
        """Views for the parameters ``names``: ``model/<name>``, ``exp_avg/<name>`` and ``exp_avg_sq/<name>``
        (writing into them writes the ledger); a wholly frozen unit's parameters have no moments, and without a
        master their ``model/`` tensor is an FP32 copy of the BF16 copy: ``writing`` keeps it, to be written back
        by :meth:`restored`. State kept on disk is not here (:meth:`disk_state_views`). With host-sharded
        ledgers only this host's elements of each view (:meth:`host_parts`) are valid."""
        slots = self.named_slots()
        out = {}
        for name in names:
            where = slots[name]
            if self._master_on_disk(where):  # (its pieces: disk_state_views)
                continue
            out[f"model/{name}"] = self.master_view(*where)
            if writing and self._view(where, "master") is None:
                self._pending.append((out[f"model/{name}"], self._view(where, "bf16")))  # type: ignore[arg-type]
            # what the ledger holds (int8: the 8-bit codes; their scales are in scale_tensors); none when frozen
            m, v = self._view(where, "exp_avg"), self._view(where, "exp_avg_sq")
            if m is not None and v is not None:
                out[f"exp_avg/{name}"], out[f"exp_avg_sq/{name}"] = m, v
        return out

    def scale_tensors(self, unit_index: int) -> dict[str, tuple[int, int, torch.Tensor]]:
        """int8 moments: ``{key: (start, stop, view)}`` of the unit's per-block scales this host holds, over the
        blocks up to its last parameter (keyed ``exp_avg_absmax/<unit name>``; the blocks start at the unit's start,
        so they are the same for every number of ranks). Empty under fp32 or for a wholly frozen unit."""
        unit = self.layout.units[unit_index]
        covered = self.ledger.extent("exp_avg", unit_index)
        ends = [s.end for s in unit.slots if s.end <= covered]
        if not self.int8 or not ends or self.ledger.disk is not None:
            return {}  # (kept on disk: disk_scale_views)
        blocks = -(-max(ends) // QUANT_BLOCK)
        lo, hi = 0, blocks
        if self.topology.host_sharded:
            per_host = self.topology.ranks_per_host * unit.shard_numel // QUANT_BLOCK
            lo, hi = min(self.topology.host * per_host, blocks), min((self.topology.host + 1) * per_host, blocks)
        out = {}
        for region in MOMENTS:
            view = self.ledger.region(f"{region}_absmax", unit_index)
            assert view is not None
            out[f"{region}_absmax/{unit.name}"] = (lo, hi, view[lo:hi])
        return out

    def disk_state_views(self, names: list[str]) -> list[tuple[str, int, int, torch.Tensor]]:
        """Moments (and a master) kept on disk: ``(key, start, stop, view)`` for the parameters ``names``, keyed as
        in :meth:`ledger_tensors` (``model/`` for the master), one entry per record a parameter's elements
        ``[start, stop)`` lie in (views of the state file mapped; writing them writes it; :meth:`release_disk_views`
        when done). Empty when everything is in memory."""
        disk = self.ledger.disk
        if disk is None:
            return []
        slots = self.named_slots()
        out = []
        for name in names:
            where = slots[name]
            regions = list(MOMENTS) if self._covered(where, "exp_avg") else []  # (a frozen parameter keeps none)
            if self._master_on_disk(where):
                regions.insert(0, "master")
            slot = self.layout.units[where[0]].slots[where[1]]
            for region in regions:
                key = "model" if region == "master" else region
                for at, view in disk.range_views(region, where[0], slot.offset, slot.end):
                    out.append((f"{key}/{name}", at, at + view.numel(), view))
        return out

    def disk_scale_views(self, unit_index: int) -> list[tuple[str, int, int, torch.Tensor]]:
        """int8 moments kept on disk: :meth:`scale_tensors` as ``(key, start, stop, view)`` per record."""
        disk = self.ledger.disk
        if disk is None or not self.int8:
            return []
        unit = self.layout.units[unit_index]
        ends = [s.end for s in unit.slots if s.end <= self.ledger.extent("exp_avg", unit_index)]
        if not ends:
            return []
        blocks = -(-max(ends) // QUANT_BLOCK)
        out = []
        for region in MOMENTS:
            for first, view in disk.part_views(f"{region}_absmax", unit_index):
                hi = min(first + view.numel(), blocks)
                if first < hi:
                    out.append((f"{region}_absmax/{unit.name}", first, hi, view[: hi - first]))
        return out

    def disk_paging(self) -> AbstractContextManager[None]:
        """Around a checkpoint's reads or writes of :meth:`disk_state_views`: their pages handed back as it goes
        (``DiskState.paged``); nothing to do when the moments are in memory."""
        return self.ledger.disk.paged() if self.ledger.disk is not None else nullcontext()

    def release_disk_views(self) -> None:
        """After a checkpoint read or wrote the views of the state file: its changes written, the mapping gone."""
        if self.ledger.disk is not None:
            self.ledger.disk.unmap()

    def host_parts(self, where: Slot) -> list[tuple[int, int]]:
        """Each host's elements ``[lo, hi)`` of a parameter, counted from its first element (``lo == hi``: none).
        One host holding everything unless the ledgers are host-sharded."""
        unit = self.layout.units[where[0]]
        slot = unit.slots[where[1]]
        if not self.topology.host_sharded:
            return [(0, slot.numel)]
        per_host = self.topology.ranks_per_host * unit.shard_numel
        parts = []
        for h in range(self.topology.hosts):
            lo = min(max(h * per_host, slot.offset), slot.offset + slot.numel)
            hi = max(min((h + 1) * per_host, slot.offset + slot.numel), lo)
            parts.append((lo - slot.offset, hi - slot.offset))
        return parts

    def model_tensors(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s state keyed as its own ``state_dict()``: master views (tied weights once) and buffers (with
        a master on disk, copies of it: :meth:`model_reader` reads them one at a time instead)."""
        meta, read = self.model_reader(module)
        return read(list(meta))

    def model_reader(
        self, module: nn.Module
    ) -> tuple[dict[str, torch.Tensor], Callable[[list[str]], dict[str, torch.Tensor]]]:
        """:meth:`model_tensors` for an export that writes a shard at a time: ``(meta, read)``, the tensors' shapes
        and dtypes (meta tensors where reading one means copying it out of the state file on disk, else the
        tensors themselves) and ``read(names)``, the tensors of ``names`` (copies read from the file where it holds
        the master: what the caller asks for at once, never the whole model)."""
        meta: dict[str, torch.Tensor] = {}
        on_disk: dict[str, Slot] = {}
        seen = set()
        for name, t in module.state_dict(keep_vars=True).items():
            where = self._slot_of.get(id(t))
            if where is None:
                meta[name] = t.detach()
            elif where not in seen:
                seen.add(where)
                if self._master_on_disk(where):
                    meta[name] = torch.empty(self.layout.units[where[0]].slots[where[1]].shape, device="meta")
                    on_disk[name] = where
                else:
                    meta[name] = self.master_view(*where)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return {n: self.master_view(*on_disk[n]) if n in on_disk else meta[n] for n in names}

        return meta, read

    def buffers(self) -> dict[str, torch.Tensor]:
        """The root's state entries that are not ledger parameters (persistent buffers), as copies."""
        return {
            n: t.detach().clone() for n, t in self.root.state_dict(keep_vars=True).items() if id(t) not in self._slot_of
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The root module's state dict with FP32 master weights (copies), keyed as ``root.state_dict()``."""
        self.require_whole_parameters("state_dict")
        out = {}
        for name, t in self.root.state_dict(keep_vars=True).items():
            where = self._slot_of.get(id(t))
            out[name] = self.master_view(*where).clone() if where is not None else t.detach().clone()
        return out

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer, step: int) -> dict:
        """``optimizer.state_dict()`` as torch's Adam/AdamW would return it, with the moments from the ledger."""
        self.require_whole_parameters("optimizer_state_dict")
        groups = optimizer.state_dict()["param_groups"]
        state, index = {}, 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                moments = self.moments(*self._slot_of[id(p)])
                if step > 0 and moments is not None:  # torch keeps no state for a parameter it never updated
                    exp_avg, exp_avg_sq = moments
                    state[index] = {
                        "step": torch.tensor(float(step)),
                        "exp_avg": exp_avg.clone(),
                        "exp_avg_sq": exp_avg_sq.clone(),
                    }
                index += 1
        return {"state": state, "param_groups": groups}

    # -- writing ------------------------------------------------------------------------------------------
    def _write(self, where: Slot, value: torch.Tensor, region: str) -> None:
        slot = self.layout.units[where[0]].slots[where[1]]
        if tuple(value.shape) != slot.shape:
            raise ValueError(f"{slot.name}: checkpoint shape {tuple(value.shape)} != model shape {slot.shape}.")
        if self.int8 and region in MOMENTS:
            if self._covered(where, region):
                self._quantize_into(where, region, value)
            return
        if region == "master" and self._master_on_disk(where):  # on the file at the next unmap (refresh_bf16's)
            assert self.ledger.disk is not None
            self.ledger.disk.write_range("master", where[0], slot.offset, value.detach().reshape(-1).float())
            return
        view = self._view(where, region)
        if view is None and region == "master":  # a frozen parameter keeping only its BF16 copy
            view = self._view(where, "bf16")
        if view is not None:  # no moments for a frozen parameter: nothing to restore there
            view.copy_(value.reshape(slot.shape))

    def _barrier(self) -> None:
        if self.topology.shard_group is not None:
            dist.barrier(group=self.topology.shard_group)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Write weights (keyed as ``root.state_dict()``) into the FP32 master and its BF16 copy."""
        self.require_whole_parameters("load_state_dict")
        own = self.root.state_dict(keep_vars=True)
        if strict:
            missing = sorted(set(own) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(own))
            if missing or unexpected:
                raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.topology.writes_ledger:
            for name, value in state_dict.items():
                where = self._slot_of.get(id(own[name])) if name in own else None
                if where is not None:
                    self._write(where, value, "master")
                elif name in own:
                    own[name].data.copy_(value)
            self.ledger.refresh_bf16()
        self._barrier()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> int:
        """Restore moments, step count and group hyper-parameters saved by :meth:`optimizer_state_dict`; returns
        the step count."""
        self.require_whole_parameters("load_optimizer_state_dict")
        self.require_moments_in_memory("load_optimizer_state_dict")
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = state.get("state", {})
        steps = {int(s["step"]) for s in saved.values()} or {0}
        if len(steps) != 1:
            raise ValueError(f"SlideDP keeps one step count for all parameters; the checkpoint has {sorted(steps)}.")
        if self.topology.writes_ledger:
            for index, s in saved.items():
                where = self._slot_of[id(params[int(index)])]
                self._write(where, s["exp_avg"], "exp_avg")
                self._write(where, s["exp_avg_sq"], "exp_avg_sq")
            self.ledger.version[:] = self.ledger.written[:] = steps.pop() if steps else 0
        for group, saved_group in zip(optimizer.param_groups, state.get("param_groups", [])):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self._barrier()
        return int(self.ledger.version.min())

    def restored(self, step: int, buffers: dict[str, torch.Tensor]) -> None:
        """After every rank wrote its part of a checkpoint into the ledger: buffers, BF16 copy and stamps."""
        own = self.root.state_dict(keep_vars=True)
        for name, value in buffers.items():
            if name in own and id(own[name]) not in self._slot_of:
                own[name].data.copy_(value)
        pending, self._pending = self._pending, []
        for scratch, bf16 in pending:  # weights of units without a master, read as FP32
            bf16.copy_(scratch.view(bf16.shape))
        self.release_disk_views()  # the moments written into the state file's mapping: on the file
        self._barrier()
        if self.topology.writes_ledger:
            self.ledger.refresh_bf16(self._host_ranges)
            self.ledger.version[:] = self.ledger.written[:] = step
        self._barrier()
