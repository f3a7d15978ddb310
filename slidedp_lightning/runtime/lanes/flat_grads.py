"""A unit's flat gradient: filling it from the parameters' gradients, and a pool of reusable buffers for it.

The flat layout of a unit (``runtime/layout.py``) puts every parameter's gradient at its offset, with zeros in the
alignment gaps and the padding; the gradient routes (``runtime/lanes/grad_route.py``) reduce that buffer, whole or in chunks.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence

import torch

from slidedp_lightning.runtime.layout import Unit


def _fill_flat(
    flat: torch.Tensor,
    unit: Unit,
    grads: Sequence[torch.Tensor | None],
    lo: int = 0,
    hi: int | None = None,
    at: int | None = None,
) -> None:
    """Write elements [lo, hi) of a unit's flat gradient layout into ``flat`` (zeros in alignment gaps and
    padding, and in the slots of frozen parameters, whose gradient is None), element ``lo`` at index ``at`` of
    ``flat`` (default: at ``lo``)."""
    hi = unit.padded if hi is None else hi
    shift = 0 if at is None else lo - at
    for a, b in unit.gaps():
        if max(a, lo) < min(b, hi):
            flat[max(a, lo) - shift : min(b, hi) - shift].zero_()
    for slot, g in zip(unit.slots, grads):
        a, b = max(slot.offset, lo), min(slot.end, hi)
        if a >= b:
            continue
        if g is None:  # a frozen parameter: no gradient
            flat[a - shift : b - shift].zero_()
        else:
            src = g.reshape(-1)[a - slot.offset : b - slot.offset]
            flat[a - shift : b - shift].copy_(src, non_blocking=True)


def pooled_elems(sizes: Sequence[int]) -> int:
    """The size of the pool's common buffers: the largest unit that is not an outlier (over twice the median unit,
    e.g. the embedding of a large vocabulary beside the decoder blocks), so one outlier does not size them all."""
    typical = 2 * statistics.median(sizes)
    return max(s for s in sizes if s <= typical)


class FlatPool:
    """Reusable FP32 flat gradient buffers, for a device without an allocator of its own.

    On a CPU "device" every unit's flat gradient would otherwise be a fresh allocation, which glibc maps anew
    (or keeps in its heap, depending on its dynamic threshold), and whose first write faults in every page (about
    20x the copy itself). The pool hands a buffer to one unit's reduction (:meth:`take`) and gets it back once
    the last shard reading it has been released; it holds as many buffers of the units' common size (``elems``) as
    units were ever in flight at once (``max_units_in_flight``). A unit larger than those (an outlier: a large
    vocabulary's embedding or untied head, reduced once a step) never takes a pooled buffer: kept, one would hold
    that unit's FP32 gradient for the whole run (1.24 GB per rank at a 152K vocabulary of width 2048). On gloo
    it is reduced piece by piece into a buffer of this rank's shard (``GradRoute._reduce_outlier``); on one rank
    or across hosts it gets a buffer of its own size for that one reduction, freed with its last user. CUDA's
    caching allocator does this for device buffers, so streams do not use it.
    """

    def __init__(self, elems: int, device: torch.device) -> None:
        self.elems = elems
        self.device = device
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._lock = threading.Lock()

    @property
    def buffers(self) -> int:
        """Pooled buffers allocated so far (in use or free)."""
        return self._made

    @property
    def nbytes(self) -> int:
        return self._made * self.elems * 4

    def take(self, users: int, elems: int | None = None) -> FlatLease:
        """A buffer of at least ``elems`` (default: the common size) for ``users`` (>= 1) holders; a pooled one
        returns to the pool when each of them has dropped it, a larger one is freed then."""
        if elems is not None and elems > self.elems:
            lease = FlatLease(self, torch.empty(elems, dtype=torch.float32, device=self.device), users)
            lease.reusable = False
            return lease
        with self._lock:
            if self._free:
                buf = self._free.pop()
            else:
                buf = torch.empty(self.elems, dtype=torch.float32, device=self.device)
                self._made += 1
        return FlatLease(self, buf, users)

    def _put(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)

    def clear(self) -> None:
        """Forget every buffer (those still leased are freed with their last user)."""
        with self._lock:
            self._free.clear()
            self._made = 0


class FlatLease:
    """One pooled buffer lent to the shards of one unit (:class:`FlatPool`)."""

    def __init__(self, pool: FlatPool, buf: torch.Tensor, users: int) -> None:
        self.pool = pool
        self.buf: torch.Tensor | None = buf  # None once the last user has dropped it
        self.users = users
        self.reusable = True

    def drop(self, reusable: bool = True) -> None:
        """One user is done with the buffer. ``reusable=False``: a collective may still write it (a failed or
        abandoned step), so it is never handed out again."""
        with self.pool._lock:
            self.users -= 1
            self.reusable = self.reusable and reusable
            last = self.users == 0
        if last and self.reusable:
            assert self.buf is not None, "a lease has one last user"
            self.pool._put(self.buf)
        if last:
            self.buf = None
