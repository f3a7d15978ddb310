"""The suite's own scheduling (tests/conftest.py): the groups handed out first exist, heaviest first."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_GROUPS, SHARED_JOBS, heaviest_first

REPO = Path(__file__).resolve().parents[1]


def test_every_heavy_group_is_a_test_file_or_a_shared_group():
    for group in HEAVY_GROUPS:
        assert group in SHARED_JOBS.values() or (REPO / group).is_file(), f"{group}: no such file or group"
    for path in SHARED_JOBS:
        assert (REPO / path).is_file(), path


def test_heavy_groups_go_first_heaviest_first_and_the_rest_keep_their_order():
    rest = ["tests/a.py", "tests/b.py", "tests/c.py"]
    heavy = sorted(HEAVY_GROUPS, key=HEAVY_GROUPS.__getitem__)  # lightest first
    ordered = heaviest_first([rest[0], *heavy, rest[1], rest[2]])
    assert ordered[: len(heavy)] == heavy[::-1]
    assert ordered[len(heavy) :] == rest


def test_a_jobs_environment_leaves_out_what_an_in_process_fit_set(monkeypatch):
    from tests.integration.conftest import clean_env

    # what an in-process Trainer (LOCAL_RANK, MASTER_PORT) and seed_everything (PL_GLOBAL_SEED) leave behind
    for name, value in {"LOCAL_RANK": "0", "MASTER_PORT": "12345", "PL_GLOBAL_SEED": "1234"}.items():
        monkeypatch.setenv(name, value)
    env = clean_env(EXTRA="1")
    assert not {"LOCAL_RANK", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"} & env.keys()
    assert env["EXTRA"] == "1" and env["OMP_NUM_THREADS"] == "1"
