"""Elastic activation checkpointing per unit (arXiv 2609.34162, §3.6) and lane 2, activation offload/reload.

Each decoder-block unit runs under one :class:`UnitPolicy`:

- ``none``: autograd keeps what it saves;
- ``full``: keep only the block input, recompute the block in backward (its parameters are resident again
  by then: backward acquires the unit before its first backward node runs);
- ``segments``: a 7-bit mask over the block's 7 internal boundaries (:mod:`slidedp_lightning.models.segments`);
  each run of segments between kept boundaries is recomputed from the state at its start;
- ``selective``: PyTorch's selective activation checkpointing; matmul outputs are saved, the rest recomputed.

Every tensor a unit retains for backward goes through :meth:`ActivationManager.retain`: saved tensors
(``saved_tensors_hooks``), the inputs a checkpointed region is recomputed from, and the operator outputs
selective checkpointing caches. ``retain`` counts the bytes and moves the policy's ``offload`` fraction of
each tensor to host memory on the offload lane; backward prefetches them back (the unit being
differentiated and the next one) before the unit's backward nodes read them.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from slidedp_lightning.runtime.activation_policy import ActivationPolicy, UnitPolicy
from slidedp_lightning.runtime.compat import disable_dispatch_modes, selective_checkpoint_contexts, tensor_version
from slidedp_lightning.runtime.lanes.streams import Lanes

log = logging.getLogger(__name__)

CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


def _without_cache(args: tuple) -> tuple:
    """``args`` with a KV cache passed positionally (GPT-2 passes it so) replaced by None: any object with a
    cache's ``update`` and ``get_seq_length`` (transformers' ``Cache``)."""
    return tuple(None if callable(getattr(a, "get_seq_length", None)) and hasattr(a, "update") else a for a in args)


# operators whose outputs selective checkpointing saves (the expensive ones to recompute)
SAVED_OPS = frozenset(
    op
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
)


class _Retained:
    """One retained tensor: kept on the device, or partly/wholly in host memory until reloaded."""

    __slots__ = ("shape", "requires_grad", "live", "kept", "host", "offloaded", "reload", "split")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape = t.shape
        self.requires_grad = t.requires_grad
        self.live: torch.Tensor | None = t  # the original, until the unit's forward ends
        self.kept: torch.Tensor | None = None  # the part that stays on the device
        self.host: Future | None = None  # -> (host tensor, marker) of the offloaded part
        self.offloaded: torch.Tensor | None = None
        self.reload: Future | None = None  # -> (device tensor, marker)
        self.split = 0


class ActivationManager:
    """Installs the policies on the decoder blocks and runs retention, offload and reload for them."""

    def __init__(
        self,
        *,
        blocks: dict[int, nn.Module],
        names: list[str],
        policy: ActivationPolicy,
        lanes: Lanes,
        param_storages: Callable[[], list],
        planner: Callable[[int, tuple, dict], ActivationPolicy] | None = None,
    ) -> None:
        self.blocks = blocks  # unit index -> decoder layer module
        self.names = names
        self._check_names(policy)
        self.policy = {u: policy.for_unit(names[u]) for u in blocks}
        # planner(unit, args, kwargs) -> ActivationPolicy: chooses the policies at the first training
        # forward of a block, when the real shapes are known (AutoPolicy)
        self.planner = planner
        self.lanes = lanes
        self._param_storages = param_storages  # () -> data_ptrs of resident unit buffers (parameters, not activations)
        self._originals: dict[int, Callable] = {}
        self._unit: int | None = None  # the block whose forward runs now
        self._step = 0
        self._seen: dict[tuple, _Retained] = {}
        self._params: set[int] = set()
        self._pending: dict[int, list[_Retained]] = defaultdict(list)  # offloaded, by unit, for prefetch
        # this step, on the device / offloaded, by unit (None: retained outside any unit's forward)
        self.retained_bytes: dict[int | None, int] = defaultdict(int)
        self.offloaded_bytes: dict[int | None, int] = defaultdict(int)
        self.last_step: dict[str, int] = {}  # totals of the last finished step (device / offloaded bytes)

    # -- installation ---------------------------------------------------------------------------------
    def install(self) -> None:
        for u, layer in self.blocks.items():
            pol = self.policy[u]
            if pol.mode == "segments":
                from slidedp_lightning.models.segments import segments_for

                segments_for(layer)  # raises a clear error for blocks without a segment adapter, before training
            self._originals[u] = layer.forward
            layer.forward = partial(self._forward, u, layer.forward)
        modes = defaultdict(list)
        for u in self.blocks:
            modes[str(self.policy[u])].append(u)
        log.info(
            "SlideDP activation policy: %s",
            "; ".join(f"{m} on {len(us)} block(s)" for m, us in modes.items()) or "no blocks",
        )

    def _check_names(self, policy: ActivationPolicy) -> None:
        blocks = {self.names[u] for u in self.blocks}
        unknown = sorted(set(policy.units) - blocks)
        if unknown:
            listed = sorted(blocks, key=lambda n: (len(n), n))
            raise ValueError(
                f"the activation policy names unit(s) {unknown} that are not decoder blocks of this model; its blocks "
                f"are {listed[:3]}{' ... ' + listed[-1] if len(listed) > 3 else ''}. Fix the policy (a plan saved "
                "for another model or depth cannot be reused)."
            )

    def set_policy(self, policy: ActivationPolicy) -> None:
        """Switch every block to ``policy`` (between steps, or before a block's forward)."""
        self._check_names(policy)
        new = {u: policy.for_unit(self.names[u]) for u in self.blocks}
        if any(p.mode == "segments" for p in new.values()):
            from slidedp_lightning.models.segments import segments_for

            for u, p in new.items():
                if p.mode == "segments":
                    segments_for(self.blocks[u])
        self.policy = new
        log.info("SlideDP activation policy set: %s", policy.to_dict())

    def measure(self, u: int, policy: UnitPolicy, args: tuple, kwargs: dict, repeats: int = 2) -> dict[str, float]:
        """Run block ``u``'s forward + backward under ``policy`` on the real call's inputs, outside training.

        The block must be resident. Returns the median seconds, the retained and offloaded activation bytes
        and, on CUDA, the peak device memory above the starting point. Gradients go nowhere (``autograd.grad``)
        and the KV cache, if any, is left out."""
        layer, forward = self.blocks[u], self._originals[u]
        kwargs = {k: (None if k in CACHE_KWARGS else v) for k, v in kwargs.items()}
        args = _without_cache(args)
        saved = (self.policy[u], self.retained_bytes[u], self.offloaded_bytes[u], self._pending.pop(u, []))
        cuda = self.lanes.device.type == "cuda"
        params = [p for p in layer.parameters() if p.requires_grad]
        times, retained, offloaded, peak = [], 0, 0, 0
        self.policy[u] = policy
        try:
            for i in range(repeats + 1):  # the first run warms up
                x = args[0].detach().requires_grad_(args[0].requires_grad)
                self.retained_bytes[u] = self.offloaded_bytes[u] = 0
                if cuda:
                    torch.cuda.synchronize(self.lanes.device)
                    torch.cuda.reset_peak_memory_stats(self.lanes.device)
                    base = torch.cuda.memory_allocated(self.lanes.device)
                t0 = time.perf_counter()
                out = self._forward(u, forward, x, *args[1:], **kwargs)
                retained, offloaded = self.retained_bytes[u], self.offloaded_bytes[u]
                inputs = [x] + params if x.requires_grad else params
                torch.autograd.grad(out, inputs, torch.ones_like(out))
                self._pending.pop(u, None)
                if cuda:
                    torch.cuda.synchronize(self.lanes.device)
                    peak = max(peak, torch.cuda.max_memory_allocated(self.lanes.device) - base)
                if i:
                    times.append(time.perf_counter() - t0)
        finally:
            self.policy[u], self.retained_bytes[u], self.offloaded_bytes[u], pending = saved
            if pending:
                self._pending[u] = pending
        return {
            "seconds": sorted(times)[len(times) // 2],
            "retained_bytes": retained,
            "offloaded_bytes": offloaded,
            "peak_bytes": peak,
        }

    def uninstall(self) -> None:
        for u, forward in self._originals.items():
            self.blocks[u].forward = forward
        self._originals.clear()

    # -- forward --------------------------------------------------------------------------------------
    def _forward(self, u: int, forward, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        pol = self.policy[u]
        if not args:  # the block input by keyword: the checkpointed region takes it positionally
            args = (kwargs.pop("hidden_states"),)
        if self.planner is not None:
            planner, self.planner = self.planner, None
            self.set_policy(planner(u, args, kwargs))
            pol = self.policy[u]
        if pol.mode != "none":
            # a recomputed block would append its keys/values to a KV cache a second time; training has no use
            # for the cache (an empty one changes no result), so checkpointed blocks run without it
            args = _without_cache(args)
            for name in CACHE_KWARGS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
        self._unit, self._seen = u, {}
        self._params = set(self._param_storages())
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                if pol.mode == "none":
                    return forward(*args, **kwargs)
                if pol.mode == "full":
                    return self._checkpoint(lambda h, *rest: forward(h, *rest, **kwargs), *args)
                if pol.mode == "selective":
                    return self._checkpoint(lambda h, *rest: forward(h, *rest, **kwargs), *args, selective=True)
                from slidedp_lightning.models.segments import run_segments, segments_for

                layer = self.blocks[u]
                state, segs = segments_for(layer).segments(layer, args, kwargs)
                return run_segments(segs, state, pol.mask, self._checkpoint)
        finally:
            self._end_unit(u)

    def _checkpoint(self, fn, *inputs, selective: bool = False):
        """Run ``fn(*inputs)`` as a region recomputed in backward from its retained tensor inputs."""
        held = [self.retain(x) if isinstance(x, torch.Tensor) else x for x in inputs]

        def region(*hs):
            return fn(*[self._region_input(h) if isinstance(h, _Retained) else h for h in hs])

        if not selective:
            return checkpoint(region, *held, use_reentrant=False)
        return checkpoint(region, *held, use_reentrant=False, context_fn=self._selective_contexts)

    def _selective_contexts(self):
        """PyTorch's selective checkpointing, its cache of saved operator outputs routed through retain()."""

        def policy(ctx, op, *args, **kwargs):
            saved = getattr(op, "overloadpacket", op) in SAVED_OPS
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

        return selective_checkpoint_contexts(policy, self._stash, self._get)

    def _stash(self, t: torch.Tensor) -> _Retained | torch.Tensor:
        """An operator output selective checkpointing caches: retained when a unit's forward saves it."""
        return self.retain(t) if self._unit is not None else t

    def _pack(self, t: torch.Tensor):
        if self._unit is None or t.untyped_storage().data_ptr() in self._params:
            return t  # a parameter (a view of a resident unit buffer) or a save outside any block
        return self.retain(t)

    def _unpack(self, packed):
        return self._get(packed) if isinstance(packed, _Retained) else packed

    # -- retention, offload and reload ----------------------------------------------------------------
    def retain(self, t: torch.Tensor) -> _Retained:
        """Account ``t`` as retained by the current unit and offload the policy's fraction of it."""
        # outside any dispatch mode: selective checkpointing counts the operators of the region, ours are not
        with disable_dispatch_modes():
            return self._retain(t)

    def _retain(self, t: torch.Tensor) -> _Retained:
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            tensor_version(t),
            t.dtype,
        )
        if key in self._seen:  # saved twice (e.g. one input of two operators): one copy
            return self._seen[key]
        u = self._unit
        r = _Retained(t)
        self._seen[key] = r
        nbytes = t.numel() * t.element_size()
        ratio = self.policy[u].offload if u is not None else 0.0
        r.split = round(ratio * t.numel())
        off = r.split * t.element_size()
        self.retained_bytes[u] += nbytes - off
        if r.split:
            assert u is not None, "an offload ratio comes from a unit's policy"
            self.offloaded_bytes[u] += off
            flat = t.detach().reshape(-1)
            if r.split < t.numel():
                r.kept = flat[r.split :].clone()  # its own memory: the original can go
            r.offloaded = flat
            r.host = self.lanes.submit("offload", self._offload, flat, r.split, u)
            self._pending[u].append(r)
        else:
            r.kept = t
        return r

    def _offload(self, flat: torch.Tensor, n: int, u: int):
        """Offload lane thread: copy the first ``n`` elements of ``flat`` into host memory."""
        lanes = self.lanes
        host = lanes.pinned(n, flat.dtype)
        with lanes.on("offload"), lanes.span("offload", "offload", self._step, u):
            lanes.wait("offload", lanes.mark("compute"))
            host.copy_(flat[:n], non_blocking=True)
            marker = lanes.mark("offload")
        lanes.hand_over(flat, "offload")
        return host, marker

    def _reload(self, r: _Retained, u: int):
        """Offload lane thread: bring ``r``'s host part back to the device."""
        lanes = self.lanes
        assert r.host is not None, "only an offloaded tensor is reloaded"
        host, marker = r.host.result()
        lanes.host_wait(marker)  # the offload copy landed (and the host part is complete)
        with lanes.on("offload"), lanes.span("offload", "reload", self._step, u):
            dev = torch.empty(host.numel(), dtype=host.dtype, device=lanes.device)
            dev.copy_(host, non_blocking=True)
            return dev, lanes.mark("offload")

    def _end_unit(self, u: int) -> None:
        """The unit's forward is over: offloaded originals may go (their copies were issued after them)."""
        for r in self._pending[u]:
            r.live = None
            r.offloaded = None
        self._unit, self._seen = None, {}

    def prefetch(self, u: int) -> None:
        """Backward reached unit ``u``: start reloading its offloaded tensors and those of the unit before it."""
        for v in (u, u - 1):
            for r in self._pending.pop(v, ()):
                r.reload = self.lanes.submit("offload", self._reload, r, v)

    def _get(self, r: _Retained) -> torch.Tensor:
        with disable_dispatch_modes():
            return self._fetch(r)

    def _fetch(self, r: _Retained) -> torch.Tensor:
        if r.live is not None:
            return r.live  # still inside the forward that retained it
        if not r.split:
            assert r.kept is not None, "a tensor kept whole stays on the device"
            return r.kept
        if r.reload is None:  # read before any prefetch (e.g. an early recompute): reload now
            for items in list(self._pending.values()):
                if r in items:
                    items.remove(r)
            r.reload = self.lanes.submit("offload", self._reload, r, -1)
        dev, marker = r.reload.result()
        self.lanes.wait("compute", marker)
        self.lanes.hand_over(dev, "compute")
        flat = dev if r.kept is None else torch.cat([dev, r.kept])
        return flat.view(r.shape)

    def _region_input(self, r: _Retained) -> torch.Tensor:
        """A region's input in forward (the original) or in the recompute (reloaded: it must require grad as
        the original did, or the recompute would save fewer tensors than the forward)."""
        x = self._get(r)
        if r.requires_grad and not x.requires_grad:
            with disable_dispatch_modes():
                x = x.detach().requires_grad_()
        return x

    def end_step(self) -> dict[str, int]:
        """Totals of the step that just ended: retained device bytes and offloaded bytes of all blocks."""
        self.last_step = {
            "retained_bytes": sum(self.retained_bytes.values()),
            "offloaded_bytes": sum(self.offloaded_bytes.values()),
        }
        self.retained_bytes.clear()
        self.offloaded_bytes.clear()
        self._pending.clear()
        self._step += 1
        return self.last_step
