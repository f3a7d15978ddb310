"""bench.capacity's report: a slope only where the peak grew with the model, never a negative extrapolation."""

from __future__ import annotations

from bench.capacity import GB, Attempt, Search, extrapolate


def _search(label: str, peaks_gb: dict[int, float]) -> Search:
    return Search(label, [Attempt(layers, layers * 10**8, "fits", {"host_peak_run": gb * GB})
                          for layers, gb in peaks_gb.items()])  # fmt: skip


def test_a_peak_that_grows_gives_a_slope_and_one_that_does_not_gives_none() -> None:
    grows = _search("slidedp", {2: 2.0, 10: 10.0})  # 8 GB more for 0.8 B more parameters
    assert grows.slope_gb_per_b() == 10.0
    flat = _search("slidedp_int8", {2: 1.0, 3: 0.99, 5: 0.98})  # sizes too close: the noise wins
    assert flat.slope_gb_per_b() is None
    assert _search("one", {4: 1.0}).slope_gb_per_b() is None


def test_the_extrapolation_says_why_a_system_has_none() -> None:
    text = extrapolate([_search("slidedp", {2: 2.0, 10: 10.0}), _search("slidedp_int8", {2: 1.0, 5: 0.98})])
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| slidedp")}
    assert "no slope: its fitting sizes' peaks did not grow" in rows["slidedp_int8"]
    assert "-" not in rows["slidedp_int8"].replace("—", "") and " B (" in rows["slidedp"]
