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
``LOCAL_RANK``, takes its ranks for started by someone else: it starts none and waits for them. After every test the
launch variables are back as the session started, including what a module-scoped fixture that runs a Trainer left:
under pytest-xdist a file's tests may run in a worker after any other file's."""

import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_SIGINT_AT_START = pytest.StashKey[object]()
# what Lightning's launchers and SlideDP's set in the environment of the process that runs a Trainer or Fabric
LAUNCH_VARIABLES = (
    "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "SLIDEDP_LAUNCHER",
)  # fmt: skip


# as the session started, before any fixture of any scope ran a Trainer
_LAUNCH_VARIABLES_AT_START = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n 2 --dist loadfile`` (pyproject): a file's tests run in one pytest-xdist worker, where its module-scoped
    jobs run once, and the files of :data:`SHARED_JOBS` in the same one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_JOBS.get(path, path)

    return FileGroups(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        config.stash[_SIGINT_AT_START] = signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_SIGINT_AT_START, None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
