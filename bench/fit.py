"""Least-squares lines through benchmark points: the host-memory slopes of the tables, the plots and
``bench.slidedp_slope``."""

from __future__ import annotations


def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line through (xs, ys): (slope, intercept)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return b, my - b * mx
