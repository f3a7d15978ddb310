"""Progress of a long pass over the weights at setup (a checkpoint read into the ledger, units initialized):
bytes done / total, rate and time left on a tqdm bar, shown on a terminal only and only when INFO logging is on."""

from __future__ import annotations

import logging
import time
from types import TracebackType

from tqdm.auto import tqdm

from slidedp_lightning.runtime.host_os import format_bytes

log = logging.getLogger(__name__)


class ByteProgress:
    """A bar of ``total`` bytes, shown when ``show`` (e.g. on local rank 0), stderr is a terminal and ``logger``
    logs INFO; :attr:`seconds` is the time since it started."""

    def __init__(self, what: str, total: int, show: bool, logger: logging.Logger = log) -> None:
        self.total = total
        self.done = 0
        self._t0 = time.perf_counter()
        self._end: float | None = None
        visible = show and total > 0 and logger.isEnabledFor(logging.INFO)
        self._bar = tqdm(
            total=total,
            desc=what,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            disable=None if visible else True,  # None: tqdm disables itself when stderr is not a terminal
            leave=False,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self._bar.update(nbytes)

    @property
    def seconds(self) -> float:
        return (self._end or time.perf_counter()) - self._t0

    def close(self) -> float:
        """Remove the bar; returns the seconds it ran."""
        if self._end is None:
            self._end = time.perf_counter()
            self._bar.close()
        return self.seconds

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def rate(nbytes: int, seconds: float) -> str:
    """``"1.15 GiB in 0.45 s (2.54 GiB/s)"``, ``"160.75 KiB in 4.21 ms (37.32 MiB/s)"``: sizes in the unit that fits,
    times under 10 ms in milliseconds."""
    took = f"{seconds:.2f} s" if seconds >= 0.01 else f"{seconds * 1e3:.2f} ms"
    return f"{format_bytes(nbytes)} in {took} ({format_bytes(nbytes / max(seconds, 1e-9))}/s)"
