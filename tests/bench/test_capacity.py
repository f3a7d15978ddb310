"""bench.capacity: its search (the deepest fitting depth; a row for every system) and its report (a slope only where
the peak grew with the model, never a negative extrapolation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import capacity
from bench.capacity import GB, QWEN3_1_7B, Attempt, Search, extrapolate, first_guess, search


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


class Clock:
    """A stand-in for ``time.perf_counter`` that only the fake attempts move."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fake_attempts(deepest_fitting: int, tried: list[int], clock: Clock, attempt_s: float):
    def attempt_at(layers: int) -> Attempt:
        tried.append(layers)
        clock.now += attempt_s
        status = "fits" if layers <= deepest_fitting else "does not fit"
        return Attempt(layers, layers * 10**8, status, {"host_peak_run": layers * GB}, attempt_s)

    return attempt_at


def _run_search(deepest_fitting: int, budget_s: float, attempt_s: float = 100.0) -> tuple[Search, list[int], float]:
    """The search's attempts and the time they took (each ``attempt_s``) for a model fitting up to ``deepest_fitting``
    layers."""
    tried: list[int] = []
    clock = Clock()
    t0 = clock.now
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capacity.time, "perf_counter", clock)
        found = search("slidedp", QWEN3_1_7B, None, Path("unused"), int(22.5 * GB), budget_s,  # type: ignore[arg-type]
                       attempt_at=_fake_attempts(deepest_fitting, tried, clock, attempt_s))  # fmt: skip
    return found, tried, clock.now - t0


def test_a_search_past_its_time_goes_on_down_until_a_depth_fits_then_stops() -> None:
    found, tried, _ = _run_search(deepest_fitting=3, budget_s=0.0)
    first = first_guess("slidedp", QWEN3_1_7B, int(22.5 * GB))
    assert first > 6 and tried[0] == first
    assert all(b < a for a, b in zip(tried, tried[1:]))  # down only, then the smaller second size for the slope
    fitting = [layers for layers in tried if layers <= 3]
    assert fitting and tried[-len(fitting) :] == fitting and len(fitting) == 2  # the first fit, then one for the slope
    assert found.largest is not None and found.largest.layers == fitting[0]


def test_a_search_with_time_finds_the_deepest_fitting_depth() -> None:
    for deepest in (1, 12, 40):
        found, tried, _ = _run_search(deepest_fitting=deepest, budget_s=10**6)
        assert found.largest is not None and found.largest.layers == deepest, tried
        assert deepest + 1 in tried or deepest == 1  # the boundary was tried from both sides


def test_a_search_that_has_a_fit_ends_within_its_time_with_the_slopes_second_size() -> None:
    # 17, 16 and 14 do not fit, 10 does (400 s), and 5 gives the slope: the least a row needs takes 500 s
    for budget_s in (0.0, 450.0, 500.0, 650.0, 900.0):
        found, tried, took = _run_search(deepest_fitting=12, budget_s=budget_s)
        assert took <= max(budget_s, 500.0), (budget_s, tried)
        fitting = sorted(a.layers for a in found.attempts if a.fits)
        assert len(fitting) >= 2 and fitting[0] <= fitting[-1] // 2, tried  # a slope, within the time
    found, tried, took = _run_search(deepest_fitting=12, budget_s=10**6)
    # with time enough (500 s stopped it at 10) the search goes on to the boundary: 12 fits, 13 does not
    assert took > 500.0 and found.largest is not None and found.largest.layers == 12 and 13 in tried, tried


def test_a_system_that_needs_bf16_is_not_run_where_the_host_computes_in_fp32(monkeypatch) -> None:
    monkeypatch.setattr(capacity, "PRECISION", "bf16-mixed")
    assert capacity.not_run("slidedp_disk_master") == "" and capacity.not_run("slidedp") == ""
    monkeypatch.setattr(capacity, "PRECISION", "32-true")
    why = capacity.not_run("slidedp_disk_master")
    assert "bf16-mixed" in why and "32-true" in why and capacity.not_run("slidedp_disk") == ""
    text = capacity.table([Search("slidedp_disk_master", why_not_run=why)], QWEN3_1_7B, int(22.5 * GB))
    assert why in text
