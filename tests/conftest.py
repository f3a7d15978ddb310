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
``LOCAL_RANK``, takes its ranks for started by someone else: it starts none and waits for them. Every test gets the
launch variables it started with back."""

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


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        config.stash[_SIGINT_AT_START] = signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_SIGINT_AT_START, None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
