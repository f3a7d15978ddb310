"""JobConfig: a misspelt or renamed key of an integration job is refused, by name, before any process starts."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from slidedp_lightning import SlideDPStrategy
from tests.integration import conftest
from tests.integration.job_config import RENAMED, STRATEGY_OPTIONS, JobConfig

BASE = dict(out="/tmp/unused", strategy="slidedp", devices=2, steps=3, batch=2, tied=True)


def test_a_misspelt_key_is_refused_with_its_name_and_the_field_it_meant() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'prefetch_windw' \(did you mean 'prefetch_window'\?\)"):
        JobConfig.from_dict({**BASE, "prefetch_windw": 3})


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_former_key_names_its_new_field(old: str) -> None:
    with pytest.raises(ValueError, match=rf"'{old}' \(did you mean '{RENAMED[old]}'\?\)"):
        JobConfig.from_dict({**BASE, old: 1})


def test_a_misspelt_key_in_a_variant_is_refused_with_the_variant_name() -> None:
    variants = {"ok": {"prefetch_window": 1}, "bad": {"grad_rout": "host_reduce"}}
    with pytest.raises(ValueError, match=r"variant 'bad': unknown key\(s\) 'grad_rout'"):
        JobConfig.from_dict({**BASE, "variants": variants})
    with pytest.raises(ValueError, match="variant 'bad'"):  # constructed directly, not from a mapping
        JobConfig(**{**BASE, "variants": variants})


@pytest.mark.parametrize("knob", ["out", "variants"])
def test_a_variant_cannot_move_the_output_or_nest_variants(knob: str) -> None:
    with pytest.raises(ValueError, match=rf"variant 'v': unknown key\(s\) '{knob}'"):
        JobConfig.from_dict({**BASE, "variants": {"v": {knob: {}}}})


def test_missing_keys_and_bad_choices_are_refused() -> None:
    with pytest.raises(ValueError, match=r"missing key\(s\) \['tied'\]"):
        JobConfig.from_dict({k: v for k, v in BASE.items() if k != "tied"})
    with pytest.raises(ValueError, match="strategy='slidedpp'"):
        JobConfig.from_dict({**BASE, "strategy": "slidedpp"})
    with pytest.raises(ValueError, match="kill_in='update_lane'"):
        JobConfig.from_dict({**BASE, "variants": {"v": {"kill_in": "update_lane"}}})


def test_json_round_trip_and_variant_merge() -> None:
    cfg = JobConfig.from_dict({**BASE, "grad_route": "host_reduce", "variants": {"w1": {"prefetch_window": 1}}})
    assert JobConfig.from_dict(json.loads(cfg.to_json())) == cfg
    v = cfg.variant("w1")
    assert (v.prefetch_window, v.grad_route, v.variants, v.out) == (1, "host_reduce", None, "/tmp/unused/w1")
    assert cfg.prefetch_window == 2  # the base is not changed by its variant


def test_strategy_fields_are_the_strategy_arguments_with_its_defaults() -> None:
    """The job's strategy knobs carry SlideDPStrategy's names and defaults, so a job that sets none of them runs
    the strategy exactly as a user who passes no arguments."""
    params = inspect.signature(SlideDPStrategy.__init__).parameters
    defaults = {f.name: f.default for f in dataclasses.fields(JobConfig)}
    for name in STRATEGY_OPTIONS:
        assert name in params, f"{name} is not a SlideDPStrategy argument"
        assert defaults[name] == params[name].default, name
    assert set(JobConfig.from_dict(BASE).strategy_options()) == set(STRATEGY_OPTIONS)


def test_run_job_and_job_runner_refuse_a_misspelt_key_before_starting_a_process(
    monkeypatch, tmp_path, job_runner
) -> None:
    def no_process(*args, **kwargs):
        raise AssertionError("a job process was started")

    monkeypatch.setattr(conftest.subprocess, "run", no_process)
    monkeypatch.setattr(conftest.subprocess, "Popen", no_process)
    common = {k: v for k, v in BASE.items() if k != "out"}
    with pytest.raises(ValueError, match="'window'"):
        conftest.run_job(tmp_path / "job", window=1, **common)
    with pytest.raises(ValueError, match="'activations'"):
        conftest.run_nodes(tmp_path / "nodes", nodes=2, activations="full@0.5", **common)
    with pytest.raises(ValueError, match="variant 'v': unknown key\\(s\\) 'chunkbytes'"):
        job_runner("typo", variants={"v": {"chunkbytes": 4096}}, **common)
    assert not (tmp_path / "job").exists() and not (tmp_path / "nodes").exists()
