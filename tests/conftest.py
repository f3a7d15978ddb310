"""The whole suite runs offline, as its machines do: the Hugging Face hub is never asked (a model id that is not
in the local cache fails at once instead of after the client's connection retries, about 20 s each), in this
process and in every job it starts (they inherit the environment).

Ctrl-C reaches the suite as it reaches an interactive Python, however it was launched: a shell without job
control starts a background command (``pytest ... &``, ``nohup``) with SIGINT ignored, Python then installs no
handler of its own, ``_thread.interrupt_main()`` does nothing and every process the tests start inherits the
ignored signal. The tests that interrupt a job (by ``interrupt_main`` or by sending SIGINT to a child) need the
signal handled, so the session handles it and gives the inherited disposition back at the end.

A test that runs a Trainer or Fabric in this process leaves Lightning's launch variables in ``os.environ``
(``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_PORT``, ...). A job started later inherits them, and Lightning, seeing
``LOCAL_RANK``, takes its ranks for started by someone else: it starts none and waits for them. ``seed_everything``
leaves ``PL_GLOBAL_SEED``, which Lightning's distributed sampler of a later job takes for its shuffling seed: that
job's data order then depends on which tests ran before it in the same process. After every test these variables
are back as the session started, including what a module-scoped fixture that runs a Trainer left: under
pytest-xdist a file's tests may run in a worker after any other file's; and a job's environment leaves them out."""

import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_SIGINT_AT_START = pytest.StashKey[object]()
# what Lightning's launchers and SlideDP's set in the environment of the process that runs a Trainer or Fabric
LAUNCH_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLIDEDP_LAUNCHER",
)  # fmt: skip
# what Lightning's seed_everything sets
SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")
FIT_VARIABLES = (*LAUNCH_VARIABLES, *SEED_VARIABLES)


def environment_for_a_job() -> dict[str, str]:
    """This process's environment without :data:`FIT_VARIABLES`: a job started with it launches its own ranks with its
    own seed, whatever an in-process fit left behind."""
    return {k: v for k, v in os.environ.items() if k not in FIT_VARIABLES}


# as the session started, before any fixture of any scope ran a Trainer
_LAUNCH_VARIABLES_AT_START = {name: os.environ.get(name) for name in FIT_VARIABLES}


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    yield
    for name, value in _LAUNCH_VARIABLES_AT_START.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Files whose tests reuse one another's jobs (cached per process by ``job_runner``): the equivalence suite's reference
# and case runs serve the lane-delay and ledger tests too.
SHARED_JOBS = {
    "tests/integration/test_equivalence.py": "equivalence-jobs",
    "tests/integration/test_lane_delays.py": "equivalence-jobs",
    "tests/integration/test_ledger.py": "equivalence-jobs",
}

# The slowest groups with their seconds in the whole suite under ``-n 2`` (``--durations=0``, 2-core AMD EPYC Zen 4,
# 2026-12-07, summed per group). Only their order is used: they are handed out first, heaviest first, so the two
# workers end together instead of one running a long file alone at the end (xdist hands out the files with the most
# tests first, which puts two 150-second tests of one file last). Groups not listed follow in xdist's order.
HEAVY_GROUPS = {
    "tests/recipes/test_finetune_data.py": 304,
    "equivalence-jobs": 192,
    "tests/recipes/test_job_knobs.py": 129,
    "tests/integration/test_signal_trials.py": 125,
    "tests/integration/test_reliability_jobs.py": 80,
    "tests/integration/test_multinode.py": 75,
    "tests/cpu_ops/test_targets.py": 64,
    "tests/bench/test_pretrained_load.py": 62,
    "tests/recipes/test_resume_job.py": 60,
    "tests/integration/test_checkpoints.py": 50,
    "tests/recipes/test_cli.py": 48,
    "tests/integration/test_requeue.py": 44,
    "tests/test_checkpoint.py": 42,
    "tests/test_export_integrity.py": 40,
    "tests/runtime/lanes/test_grad_route.py": 39,
}


def heaviest_first(groups: list[str]) -> list[str]:
    """``groups`` in the order they are handed out: :data:`HEAVY_GROUPS` by weight, then the rest as given."""
    return sorted(groups, key=lambda group: -HEAVY_GROUPS.get(group, 0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n 2 --dist loadfile`` (pyproject): a file's tests run in one pytest-xdist worker, where its module-scoped
    jobs run once, and the files of :data:`SHARED_JOBS` in the same one; :func:`heaviest_first` orders them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_JOBS.get(path, path)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first hand-out: the work queue is complete
                self.workqueue = OrderedDict((g, self.workqueue[g]) for g in heaviest_first(list(self.workqueue)))
                self.ordered = True
            super()._assign_work_unit(node)

    return FileGroups(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        config.stash[_SIGINT_AT_START] = signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_SIGINT_AT_START, None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
