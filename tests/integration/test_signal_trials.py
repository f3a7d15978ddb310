"""Signals at random moments of 2-rank jobs, each job in a session of its own with a deadline: SIGKILL of local
rank 0 from process start to the first step leaves no shared memory; SIGTERM to the launcher or to the launched
rank, from start to end (setup, training, checkpoint saves), ends every rank within 30 s with a message and leaves
nothing but complete checkpoints. The moments come from a fixed seed and are printed (``pytest -s`` shows them);
``SLIDEDP_SIGNAL_TRIALS`` sets the number of trials (4 in the suite, one of each kind; 20 for the acceptance run)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from slidedp_lightning.checkpoints.distributed import META, read_meta
from tests.integration.signal_trials import Trial, baseline, run_trial
from tests.shm_usage import private_tmpfs, used_bytes

# 20 or more multi-process jobs per test: minutes each on a loaded machine, beyond the suite's 600 s timeout
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(3600)]

TRIALS = int(os.environ.get("SLIDEDP_SIGNAL_TRIALS", "4"))  # one of each kind; the acceptance run: 20
SEED = 20261201
JOB = dict(pg_timeout=60)  # a loaded machine: the rendezvous must not time out on its own


def moments(n: int, upto: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [round(rng.uniform(0.0, upto), 2) for _ in range(n)]


def report(name: str, rows: list[tuple[float, Trial]]) -> None:
    print(f"\n{name}: {len(rows)} trials (seed {SEED})")
    for moment, t in rows:
        print(
            f"  moment {moment:6.2f} s  phase {t.phase:8s}  launcher exit {t.code}  "
            f"all gone after {t.exit_s if t.exit_s is None else round(t.exit_s, 2)} s  left {t.leftover}"
        )


def complete_checkpoints(ckpt: Path) -> list[str]:
    """The checkpoint directory holds complete checkpoints only: no hidden (unfinished) save, each readable."""
    if not ckpt.exists():
        return []
    names = sorted(os.listdir(ckpt))
    assert not [n for n in names if n.startswith(".")], f"an unfinished save was left: {names}"
    for name in names:
        read_meta(ckpt / name)  # the metadata, written last of all, parses
        assert (ckpt / name / ".metadata").is_file() and (ckpt / name / META).is_file(), name
    return names


# a training tail of 4 steps of 0.5 s, each saving a checkpoint: a moment past a fast run's first step still hits it
TRIAL_JOB = dict(steps=4, save_every=1, step_sleep=0.5, **JOB)


@pytest.fixture(scope="module")
def trial_baseline(tmp_path_factory) -> tuple[float, float]:
    """The trials' job without a signal, run once for every test here: (seconds to its first step, in all). Its
    ledger is in the private tmpfs it was given while it trains, and gone from it after."""
    out = tmp_path_factory.mktemp("signals") / "baseline"
    with private_tmpfs() as shm:
        empty = used_bytes(shm)
        code, first, total, output = baseline(out, env={"SLIDEDP_SHM_DIR": shm}, **TRIAL_JOB)
        assert code == 0, output[-3000:]
        during = int((out / "shm_rank0").read_text())
        # pages count once written: at least the FP32 master (78,208 params x 4 B) is in the ledger directory's tmpfs
        assert during - empty >= 78_208 * 4, f"the ledger is not in {shm}: {during - empty} bytes used there"
        assert used_bytes(shm) == empty, "the ledger's memory outlived the job"
    assert complete_checkpoints(out / "ckpt") == [f"step-{s}" for s in range(1, 5)]
    return first, total


def test_sigkill_of_local_rank_0_before_the_first_step_leaves_no_shared_memory(
    tmp_path: Path, trial_baseline: tuple[float, float]
) -> None:
    first, _ = trial_baseline
    with private_tmpfs() as shm:
        env = {"SLIDEDP_SHM_DIR": shm}
        empty = used_bytes(shm)
        rows = []
        for i, moment in enumerate(moments(TRIALS, first, SEED)):
            t = run_trial(
                tmp_path / f"kill{i}", moment, signal.SIGKILL, "launcher", env=env, deadline_s=90, **TRIAL_JOB
            )
            rows.append((moment, t))
            assert os.listdir(shm) == [] and used_bytes(shm) == empty, (moment, t.phase, used_bytes(shm) - empty)
        report(f"SIGKILL of local rank 0 in [0, {first:.1f}] s (the first step)", rows)
        assert all(not t.leftover for _, t in rows), "a rank outlived local rank 0 by more than 90 s"


@pytest.mark.parametrize("target", ["launcher", "rank1"])
def test_sigterm_at_random_moments_ends_every_rank_within_30_s_leaving_complete_checkpoints_only(
    tmp_path: Path, target: str, trial_baseline: tuple[float, float]
) -> None:
    cfg, (first, total) = TRIAL_JOB, trial_baseline
    with private_tmpfs() as shm:
        env = {"SLIDEDP_SHM_DIR": shm}
        empty = used_bytes(shm)
        rows = []
        seed = SEED + (target == "rank1")
        for i, moment in enumerate(moments(TRIALS, total, seed)):
            # of every four trials: two anywhere in the run, one in training (past the baseline's first step), one
            # inside a checkpoint save (up to 0.3 s after its hidden directory appeared)
            in_save = i % 4 == 3
            if i % 4 == 2:
                moment = round(first + moment / total * (total - first), 2)
            elif in_save:
                moment = round(moment / total * 0.3, 3)
            out = tmp_path / f"term{i}"
            t = run_trial(out, moment, signal.SIGTERM, target, env=env, deadline_s=30, in_save=in_save, **cfg)
            if in_save:
                t.phase = f"{t.phase}+"
            rows.append((moment, t))
            assert not t.leftover, f"moment {moment}: processes {t.leftover} still ran 30 s after SIGTERM"
            if t.signalled is not None:
                told = (
                    "received SIGTERM" in t.output  # the strategy's guard, during a run
                    or "terminated with code -15" in t.output  # Lightning's launcher names its rank
                    or "was ended by SIGTERM" in t.output  # the launching rank names its rank process
                    or t.code == -signal.SIGTERM  # the launcher itself, ended by the signal before any handler
                )
                assert told, f"moment {moment} ({t.phase}): no message says why the job ended:\n{t.output[-3000:]}"
            complete_checkpoints(out / "ckpt")
            assert os.listdir(shm) == [] and used_bytes(shm) == empty, (moment, t.phase)
        report(f"SIGTERM to {target} in [0, {total:.1f}] s (first step at {first:.1f} s; +: inside a save)", rows)
        phases = {t.phase.rstrip("+") for _, t in rows}
        assert "setup" in phases and ({"training", "save"} & phases), phases
