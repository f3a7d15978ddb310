"""The benchmarks are fair: every system compared in one table gets the same workload (no benchmark runs here)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench.baselines.workload import SYSTEMS, ModelShape
from bench.configs import SCALES, SLOPE_SYSTEMS, plan, runs_by_group, scale


def fake_init(shape: ModelShape, seq: int, root: Path) -> Path:
    return root / f"init-{shape.name}-{seq}.pt"  # one file per (shape, seq), as init_file_for


@pytest.fixture(
    params=[(name, fast) for name in SCALES for fast in (False, True)], ids=lambda p: p[0] + "-quick" * p[1]
)
def jobs(request):
    name, fast = request.param
    return plan(scale(name, fast=fast), Path("/nonexistent"), init=fake_init)


def test_every_group_compares_the_same_workload(jobs):
    for group, runs in runs_by_group(jobs).items():
        first = runs[0].spec
        for run in runs[1:]:
            s = run.spec
            assert s.model == first.model, (group, run.name)
            assert (s.global_batch, s.seq, s.steps, s.warmup) == (
                first.global_batch,
                first.seq,
                first.steps,
                first.warmup,
            )
            assert s.init_file == first.init_file and s.init_file, (group, run.name)
            assert s.hyper == first.hyper, (group, run.name)
            assert (s.precision, s.checkpointing, s.data_seed) == (
                first.precision,
                first.checkpointing,
                first.data_seed,
            )
            assert s.ranks == first.ranks and s.accelerator == first.accelerator, (group, run.name)
            assert s.workload() == first.workload(), (group, run.name)


def test_systems_table_has_every_system_at_two_sizes_and_the_slope_three(jobs):
    sc_groups = {g: rs for g, rs in runs_by_group(jobs).items() if g.startswith("systems/")}
    assert len(sc_groups) >= 3, "the host-memory slope needs at least 3 model sizes"
    sizes = {rs[0].spec.model.num_params for rs in sc_groups.values()}
    assert len(sizes) == len(sc_groups)
    every = [rs for rs in sc_groups.values() if Counter(r.spec.system for r in rs) == Counter(SYSTEMS)]
    assert len(every) >= 2, "every system at two sizes at least"
    for rs in sc_groups.values():
        assert set(SLOPE_SYSTEMS) <= {r.spec.system for r in rs}


@pytest.mark.parametrize("name", SCALES)
def test_the_full_scales_run_every_system_at_every_size(name):
    jobs = plan(scale(name), Path("/nonexistent"), init=fake_init)
    for group, rs in runs_by_group(jobs).items():
        if group.startswith("systems/"):
            assert Counter(r.spec.system for r in rs) == Counter(SYSTEMS), group


def test_quick_keeps_the_workload_of_the_full_scale():
    full, quick = scale("cpu"), scale("cpu", fast=True)
    assert quick.slope_shapes == full.slope_shapes[:3] and quick.systems_shapes == full.slope_shapes[:2]
    assert (quick.batch, quick.seq, quick.steps, quick.loss_steps) == (
        full.batch,
        full.seq,
        full.steps,
        full.loss_steps,
    )


def test_memory_runs_have_a_job_of_their_own(jobs):
    for job in jobs:
        if job.memory:
            assert len(job.runs) == 1
    assert all(j.memory for j in jobs if j.runs[0].group.startswith("systems/"))


def test_run_names_are_unique_and_steps_leave_measured_steps(jobs):
    names = [r.name for j in jobs for r in j.runs]
    assert len(names) == len(set(names))
    for j in jobs:
        for r in j.runs:
            assert r.spec.steps - r.spec.warmup - 1 >= 2
            assert r.spec.global_batch % r.spec.ranks == 0


def test_loss_equivalence_runs_200_steps_in_both_precisions(jobs):
    groups = runs_by_group(jobs)
    for precision in ("32-true", "bf16-mixed"):
        runs = groups[f"loss/{precision}"]
        assert {r.spec.system for r in runs} == {"slidedp", "fsdp2"}
        assert all(r.spec.steps == 200 for r in runs)


@pytest.mark.parametrize("kind", ["tied", "untied", "moe"])
def test_shape_param_count_matches_the_model(kind: str):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    sc = scale("cpu")
    shape = sc.moe_shape if kind == "moe" else replace(sc.loss_shape, tied=kind == "tied")
    model = AutoModelForCausalLM.from_config(shape.hf_config(32))
    assert sum(p.numel() for p in model.parameters()) == shape.num_params
