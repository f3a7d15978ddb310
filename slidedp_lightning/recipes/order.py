"""The training data's order, resumable: a checkpoint records how far into which epoch the run was, and the resumed
run's sampler starts there, so it sees the batches the uninterrupted run would have seen."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

POSITION = "slidedp_data_position"  # the checkpoint's entry: {"epoch": e, "batches": batches done in epoch e}


class ResumingSampler(DistributedSampler):
    """``DistributedSampler`` (the order Lightning's own would give), which in one epoch can start after the
    examples of the batches a resumed run already trained on."""

    def __init__(self, *args: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip in it)

    def resume_at(self, epoch: int, batches: int) -> None:
        self._resume = (int(epoch), int(batches))

    def __iter__(self) -> Iterator[Any]:
        indices = super().__iter__()
        if self._resume is None or self._resume[0] != self.epoch:
            return indices
        skip = self._resume[1] * self.batch_size
        return iter(list(indices)[skip:])
