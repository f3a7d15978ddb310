"""Build locks of torch extensions: a stale one is named (and removed where the benchmark owns the directory), and
no wait is without a bound."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench import prepare
from bench.baselines import extensions, lifetime


def stale(root: Path, name: str, age_s: float) -> Path:
    lock = root / name / extensions.BATON
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_lock_in_the_default_directory_is_named_with_its_age(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    lock = stale(tmp_path / "torch_extensions" / "py311_cpu", "cpu_adam", 26 * 60)
    found = extensions.find_locks(extensions.default_dir())
    assert [x.path for x in found] == [lock]
    note = extensions.stale_lock_note(found, extensions.default_dir())
    assert str(lock) in note and "26.0 min ago" in note and "waits without end" in note


def test_the_owned_directory_removes_its_stale_locks_by_name(tmp_path):
    lock = stale(tmp_path, "cpu_adam", 60)
    with extensions.OwnedBuildDir(tmp_path) as owned:
        owned.acquire(timeout_s=5)
        removed = owned.clear_stale()
    assert [x.path for x in removed] == [lock] and not lock.exists()


def test_a_second_holder_waits_with_a_bound_and_names_the_first(tmp_path):
    first = extensions.OwnedBuildDir(tmp_path)
    first.acquire(timeout_s=5)
    heard: list[str] = []
    with pytest.raises(TimeoutError, match=rf"\(pid {os.getpid()}\) holds .*{extensions.FLOCK}"):
        extensions.OwnedBuildDir(tmp_path).acquire(timeout_s=0.6, on_wait=heard.append, every_s=0.2)
    assert heard and f"waiting for pid {os.getpid()}" in heard[0]
    first.release()
    extensions.OwnedBuildDir(tmp_path).acquire(timeout_s=1)  # free again


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_the_op_build_is_bounded_and_clears_the_lock_it_left(tmp_path, monkeypatch):
    """A build that hangs (here: holds its baton and sleeps) is stopped at the time limit, with a message; its lock
    is gone after, and its process too."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "default"))
    old = stale(tmp_path / "owned", "cpu_adam", 3600)
    pidfile = tmp_path / "build.pid"
    hang = (
        "import os, time; from bench.baselines.lifetime import die_with_parent; die_with_parent()\n"
        f"open({str(old)!r}, 'w').close(); open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    lines: list[str] = []
    monkeypatch.setattr(prepare, "PROGRESS_EVERY_S", 0.5)
    why = prepare.build_deepspeed_ops("cpu", lines.append, tmp_path / "build.log", timeout_s=3.0,
                                      root=tmp_path / "owned", code=hang)  # fmt: skip
    assert why.startswith("failed: DeepSpeed's cpu_adam op did not build in 3 s")
    assert any(f"removed a stale build lock, {old}" in line for line in lines)
    assert any("still running" in line and str(old) in line for line in lines)  # the lock it waits on is named
    assert not old.exists() and lifetime.tracked() == []
    pid = int(pidfile.read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


def test_without_deepspeed_the_zero_rows_say_not_installed(tmp_path, monkeypatch):
    real = prepare.importlib.util.find_spec
    monkeypatch.setattr(prepare.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    prep = prepare.prepare("cpu", 2, tmp_path, lambda _: None, needs_deepspeed=True, kernels=False)
    assert prep.blocked["zero_offload"].startswith("not installed: DeepSpeed is not installed")
