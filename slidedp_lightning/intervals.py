"""Arithmetic on half-open time intervals, shared by the runtime's lane trace and the step-time model.

Pure: imports nothing, so the step-time model can use it without the runtime, the kernels or Lightning.
"""

from __future__ import annotations


def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
