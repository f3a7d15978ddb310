"""The whole suite runs offline, as its machines do: the Hugging Face hub is never asked (a model id that is not
in the local cache fails at once instead of after the client's connection retries, about 20 s each), in this
process and in every job it starts (they inherit the environment).

Ctrl-C reaches the suite as it reaches an interactive Python, however it was launched: a shell without job
control starts a background command (``pytest ... &``, ``nohup``) with SIGINT ignored, Python then installs no
handler of its own, ``_thread.interrupt_main()`` does nothing and every process the tests start inherits the
ignored signal. The tests that interrupt a job (by ``interrupt_main`` or by sending SIGINT to a child) need the
signal handled, so the session handles it and gives the inherited disposition back at the end."""

import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_SIGINT_AT_START = pytest.StashKey[object]()


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        config.stash[_SIGINT_AT_START] = signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_unconfigure(config: pytest.Config) -> None:
    previous = config.stash.get(_SIGINT_AT_START, None)
    if previous is not None:
        signal.signal(signal.SIGINT, previous)
