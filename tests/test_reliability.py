"""Reliability, in process (world size 1): process groups destroyed at teardown, what would silently see no
gradient refused before training, checkpoint saves that clean up after killed ones and follow symbolic links,
errors that name their cause, and SIGTERM ending a run without a collective."""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.checkpoints.distributed import is_sharded
from slidedp_lightning.checkpoints.files import remove_stale_saves
from slidedp_lightning.process import groups as process_groups
from slidedp_lightning.process import signals
from slidedp_lightning.runtime import topology
from slidedp_lightning.runtime.host_os import format_bytes, process_start_time
from slidedp_lightning.runtime.lanes.liveness import Liveness, PeerFailure, wait_until
from slidedp_lightning.runtime.ledger import preflight
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry
from slidedp_lightning.runtime.ledger.host_ledger import HostLedger
from slidedp_lightning.runtime.ledger.preflight import SHM_ENV, HostMemoryError, check_host_memory, shm_dir
from slidedp_lightning.runtime.topology import Topology
from tests.trainers import (
    TinyLM,
    adamw,
    data,
    quiet_and_clean,  # noqa: F401
    slidedp_shm,
    trainer,
)

COLLECTIVE_THREADS = ("gloo", "tcpstore", "nccl")  # pt_gloo_runloop, gloo_tcp_loop, pt_tcpstore_uv, pt_nccl_*


def collective_threads() -> list[str]:
    """This process's native threads that belong to a collective backend or a TCPStore."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if any(key in name for key in COLLECTIVE_THREADS):
            names.append(name)
    return sorted(names)


def settled_threads(timeout_s: float = 10.0) -> list[str]:
    """:func:`collective_threads` once it stops changing: a gloo group starts some of its threads after its first
    collective has returned, and a destroyed one's end shortly after."""
    deadline = time.monotonic() + timeout_s
    last = collective_threads()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = collective_threads()
        if now == last:
            return now
        last = now
    return last


# -- A: process groups ---------------------------------------------------------------------------------------


class SeesThreads(L.Callback):
    def __init__(self) -> None:
        self.during: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.during = collective_threads()


def test_a_run_leaves_no_collective_thread_and_a_later_run_starts_again() -> None:
    before = collective_threads()
    seen = SeesThreads()
    module = TinyLM()
    t = trainer(max_steps=2, callbacks=[seen])
    t.fit(module, data())
    assert any("gloo" in n for n in seen.during) and any("tcpstore" in n for n in seen.during), seen.during
    assert not dist.is_initialized(), "the default group SlideDP created is destroyed at teardown"
    assert collective_threads() == before
    t.fit(module, data())  # the same trainer again: a new group
    assert not dist.is_initialized() and collective_threads() == before
    t2 = trainer(max_steps=1)
    t2.fit(module, data())
    assert not dist.is_initialized() and collective_threads() == before
    assert t2.global_step == 1


def test_the_users_default_group_is_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    world = dist.group.WORLD
    trainer(max_steps=1).fit(TinyLM(), data())
    assert dist.is_initialized() and dist.group.WORLD is world
    assert not process_groups.owns_default_group()


def test_destroy_groups_ends_the_threads_of_the_runtimes_groups(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    dist.all_reduce(torch.ones(2))  # the default group's threads start with its first collectives
    with_world = settled_threads()
    group = dist.new_group([0])
    dist.all_reduce(torch.ones(2), group=group)
    topo = Topology(param_group=group, created=(group,))
    del group
    assert len(settled_threads()) > len(with_world)
    released = topo.destroy_groups()
    del topo
    assert released.param_group is None and released.created == ()
    assert settled_threads() == with_world
    released.destroy_groups()  # nothing left to destroy: no error


def test_build_records_every_group_it_creates(monkeypatch) -> None:
    """Every group this rank is a member of, other hosts' shard groups included; none it is not a member of."""
    outside = object()
    made: list[tuple[int, ...]] = []

    def new_group(ranks):
        made.append(tuple(ranks))
        return ("group", tuple(ranks)) if 3 in ranks else outside

    fake = SimpleNamespace(
        is_initialized=lambda: True,
        new_group=new_group,
        group=SimpleNamespace(WORLD=("group", "world")),
        GroupMember=SimpleNamespace(NON_GROUP_MEMBER=outside),
    )
    monkeypatch.setattr(topology, "dist", fake)
    t = Topology.build(global_rank=3, local_rank=1, ranks_per_host=2, hosts=2, param_group=True)
    mine = [("group", r) for r in made if 3 in r]
    assert list(t.created) == mine and len(made) == 7  # 2 hosts, 2 cross, leaders, 2 shard groups
    assert {t.host_group, t.cross, t.param_group} <= set(t.created) and t.world not in t.created
    assert t.released().created == ()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- B: what would see no gradient -----------------------------------------------------------------------------


class Manual(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5)
        opt.step()
        opt.zero_grad()
        self.losses.append(loss.item())


class LogsGradNorm(TinyLM):
    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.log_dict(grad_norm(self, norm_type=2))


class ChecksGrads(TinyLM):
    def on_after_backward(self):
        assert all(p.grad is None or p.grad.isfinite().all() for p in self.parameters())


class ClipsItsOwnWay(TinyLM):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


class GradLogger(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


def _refused_before_any_ledger(module: TinyLM, match: str, **kw) -> str:
    shm_before = slidedp_shm()
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    t = trainer(max_steps=2, **kw)
    with pytest.raises(ValueError, match=match) as info:
        t.fit(module, data())
    assert module.losses == [] and t.strategy.engine is None
    for n, p in module.named_parameters():
        assert not p.is_meta and torch.equal(p.detach(), values[n]), n
    assert slidedp_shm() <= shm_before
    return str(info.value)


def test_manual_optimization_is_refused_before_training_naming_what_works() -> None:
    message = _refused_before_any_ledger(Manual(), "automatic_optimization = False")
    for works in ("accumulate_grad_batches", "gradient_clip_val", "last_grad_norm"):
        assert works in message


@pytest.mark.parametrize(
    "module, callbacks, named",
    [
        (LogsGradNorm, [], "LogsGradNorm.on_before_optimizer_step"),
        (ChecksGrads, [], "ChecksGrads.on_after_backward"),
        (ClipsItsOwnWay, [], "ClipsItsOwnWay.configure_gradient_clipping"),
        (TinyLM, [GradLogger()], "GradLogger.on_before_optimizer_step"),
    ],
)
def test_hooks_that_would_see_no_gradient_are_refused_before_training(module, callbacks, named) -> None:
    message = _refused_before_any_ledger(module(), named, callbacks=callbacks)
    assert "grad_norm" in message and "gradient_clip_val" in message and "last_grad_norm" in message


class RecordsNorm(L.Callback):
    def __init__(self) -> None:
        self.norms: list[float | None] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.norms.append(trainer.strategy.last_grad_norm)


@pytest.mark.parametrize("update, clip", [("deferred", None), ("auto", 0.05)])
def test_last_grad_norm_is_each_steps_global_gradient_norm(update: str, clip: float | None) -> None:
    module = TinyLM()
    ref = copy.deepcopy(module.model)
    seen = RecordsNorm()
    trainer(max_steps=3, strategy=SlideDPStrategy(update=update), gradient_clip_val=clip, callbacks=[seen]).fit(
        module, data()
    )
    ref_opt = adamw(ref.parameters())
    expected = []
    for batch in module.batches:
        ref_opt.zero_grad()
        ref(input_ids=batch, labels=batch).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else float("inf"))
        expected.append(norm.item())
        ref_opt.step()
    assert len(seen.norms) == 3
    for got, want in zip(seen.norms, expected):
        assert got is not None and abs(got - want) <= 1e-4 * want, (seen.norms, expected)


def test_last_grad_norm_is_none_under_immediate_updates() -> None:
    seen = RecordsNorm()
    trainer(max_steps=2, strategy=SlideDPStrategy(update="immediate"), callbacks=[seen]).fit(TinyLM(), data())
    assert seen.norms == [None, None]


# -- C: checkpoints, messages, stopped ranks -------------------------------------------------------------------


class SaveAt(L.Callback):
    def __init__(self, path, step: int = 1) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _dead_process() -> tuple[int, str]:
    """The pid and start time of a process that has exited."""
    proc = subprocess.Popen(["sleep", "30"])
    started = process_start_time(proc.pid)
    proc.kill()
    proc.wait()
    assert started is not None and process_start_time(proc.pid) != started
    return proc.pid, started


def test_a_killed_saves_hidden_directory_is_removed_by_the_next_save_to_that_path(tmp_path) -> None:
    import socket

    host = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())
    pid, started = _dead_process()
    me = os.getpid()
    stale = tmp_path / f".ck.tmp-{host}-{pid}-{started}-0123abcd"
    stale_old = tmp_path / f".ck.old-{host}-{pid}-{started}-4567cdef"
    live = tmp_path / f".ck.tmp-{host}-{me}-{process_start_time(me)}-89abcdef"
    elsewhere = tmp_path / f".ck.tmp-otherhost-{pid}-{started}-00000000"
    other_name = tmp_path / f".ck2.tmp-{host}-{pid}-{started}-11111111"
    for d in (stale, stale_old, live, elsewhere, other_name):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"\0" * 4096)
    # the first save finds no checkpoint at the path: the hidden previous one is kept (see the next test)
    trainer(max_steps=2, callbacks=[SaveAt(tmp_path / "ck", 1), SaveAt(tmp_path / "ck", 2)]).fit(TinyLM(), data())
    assert is_sharded(tmp_path / "ck")
    left = {p.name for p in tmp_path.iterdir()}
    assert stale.name not in left and stale_old.name not in left
    assert {live.name, elsewhere.name, other_name.name} <= left, "a live save's, another host's or path's are kept"
    assert left == {"ck", live.name, elsewhere.name, other_name.name}, "the save left nothing of its own"


def test_a_replaced_checkpoint_is_kept_while_the_path_is_missing(tmp_path) -> None:
    """A save killed between its two renames: the hidden previous checkpoint is the only whole copy."""
    import socket

    host = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())
    pid, started = _dead_process()
    old = tmp_path / f".ck.old-{host}-{pid}-{started}-4567cdef"
    old.mkdir()
    assert remove_stale_saves(tmp_path / "ck") == [] and old.exists()
    (tmp_path / "ck").mkdir()
    assert remove_stale_saves(tmp_path / "ck") == [old] and not old.exists()


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_checkpoint_path_that_is_a_symlink_is_written_at_its_target(tmp_path, target_exists: bool) -> None:
    target = tmp_path / "disk" / "ck-1"
    target.parent.mkdir()
    if target_exists:
        target.mkdir()
        (target / "stale-file").write_text("from an older checkpoint")
    link = tmp_path / "last"
    link.symlink_to(target)
    trainer(max_steps=2, callbacks=[SaveAt(link, step=1), SaveAt(link, step=2)]).fit(TinyLM(), data())
    assert link.is_symlink() and Path(os.readlink(link)) == target, "the link stays and names the new checkpoint"
    assert is_sharded(target) and not (target / "stale-file").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["ck-1"], "no hidden directory left"
    trainer(max_steps=3).fit(TinyLM(), data(), ckpt_path=str(link))


@pytest.mark.parametrize(
    "value, error, match",
    [
        ("{missing}", FileNotFoundError, "does not exist"),
        ("{file}", FileNotFoundError, "is not a directory"),
        ("  ", ValueError, "set but empty"),
    ],
)
def test_a_bad_shm_dir_is_refused_naming_the_variable(tmp_path, monkeypatch, value, error, match) -> None:
    (tmp_path / "file").write_text("")
    value = value.format(missing=tmp_path / "missing", file=tmp_path / "file")
    monkeypatch.setenv(SHM_ENV, value)
    with pytest.raises(error, match=match) as info:
        shm_dir()
    assert SHM_ENV in str(info.value)
    module = TinyLM()
    with pytest.raises(error, match=SHM_ENV):
        trainer(max_steps=1).fit(module, data())
    assert module.losses == []


def test_an_unwritable_shm_dir_is_refused_naming_the_variable(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SHM_ENV, str(tmp_path))
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=f"{SHM_ENV}=.*not writable"):
        shm_dir()


def test_a_ledger_that_cannot_be_created_names_where_the_directory_came_from(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(SHM_ENV, str(tmp_path))
    geometry = LedgerGeometry(
        total=1024, num_units=2, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4
    )
    with pytest.raises(FileNotFoundError, match=f"{SHM_ENV}=.*No such file"):
        HostLedger(str(tmp_path / "removed"), geometry, create=True)  # the directory went away


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (5 << 20, "5.00 MiB"),
        (3 << 30, "3.00 GiB"),
        (2 << 40, "2048.00 GiB"),
    ],
)
def test_sizes_are_formatted_with_a_unit_that_fits(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_a_small_ledger_that_does_not_fit_reports_its_size_in_a_unit_that_fits(monkeypatch) -> None:
    monkeypatch.setattr(preflight, "available_host_bytes", lambda directory="": (100 << 10, 1 << 30))
    geometry = LedgerGeometry(
        total=1 << 18, num_units=4, world_size=1, staging_slots=0, staging_elems=0, staging_itemsize=4
    )
    with pytest.raises(HostMemoryError) as info:
        check_host_memory(geometry, 250_000)
    message = str(info.value)
    assert "0.00 GiB" not in message and f"needs {format_bytes(geometry.nbytes)}" in message
    assert "needs 3.5" in message and "MiB" in message and "only 100.00 KiB is available" in message


def test_a_wait_that_times_out_names_the_stopped_rank() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while signals.process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        liveness = Liveness(pids=lambda: [0, proc.pid], timeout_s=0.3)
        with pytest.raises(PeerFailure, match=rf"rank 1 \(pid {proc.pid}\) of this host is stopped"):
            wait_until(lambda: False, liveness, "a test")
    finally:
        proc.kill()
        proc.wait()


def test_stopped_launched_ranks_are_killed_and_running_ones_left_alone() -> None:
    stopped, running = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while signals.process_state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        signals._kill_stopped([stopped, running])
        assert stopped.poll() == -signal.SIGKILL
        assert running.poll() is None
    finally:
        for proc in (stopped, running):
            proc.kill()
            proc.wait()


def test_after_a_run_that_ended_well_the_launcher_waits_for_its_ranks_and_names_one_ended_by_a_signal(caplog) -> None:
    import sys

    settle = signals.LaunchedAtExit(at_exit=False)
    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])  # still finishing its run
    killed = subprocess.Popen(["sleep", "60"])
    stopped = subprocess.Popen(["sleep", "60"])
    try:
        killed.terminate()
        killed.wait(10)
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while signals.process_state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        settle.update([late, killed, stopped], failed=False, wait_s=30)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            assert settle.settle(), "a rank ended by a signal fails the job"
        assert late.returncode == 0, "the launcher did not wait for a rank still finishing"
        assert time.monotonic() - started < 20, "it waited for a stopped rank, which cannot end on its own"
        said = [r.getMessage() for r in caplog.records]
        assert f"SlideDP: after the run, the rank process {killed.pid} was ended by SIGTERM: this job failed." in said
        assert any(str(stopped.pid) in m and "have not ended" in m for m in said), said
        settle.update([late], failed=False, wait_s=30)
        assert not settle.settle(), "every rank ended well"
    finally:
        for proc in (late, killed, stopped):
            proc.kill()
            proc.wait()


# -- D: signals -------------------------------------------------------------------------------------------


class Terminated(TinyLM):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().training_step(batch, batch_idx)


def test_sigterm_during_a_run_stops_it_at_once_without_a_collective(caplog) -> None:
    shm_before = slidedp_shm()
    handler = signal.getsignal(signal.SIGTERM)
    module = Terminated()
    t = trainer(max_steps=5)
    with pytest.raises(signals.SignalExit) as info:
        t.fit(module, data())
    assert info.value.code == 128 + signal.SIGTERM
    assert len(module.losses) == 1, "the step that received the signal did not run on"
    assert t.strategy.engine is None and slidedp_shm() <= shm_before
    assert signal.getsignal(signal.SIGTERM) == handler, "the handlers of before the run are back"
    assert any("received SIGTERM" in r.getMessage() and f"pid {os.getpid()}" in r.getMessage() for r in caplog.records)
    for p in module.parameters():
        assert not p.is_meta and p.device.type == "cpu"


def test_a_signal_during_teardown_is_raised_once_teardown_is_done() -> None:
    guard = signals.SignalGuard(lambda: "rank 0", lambda: [])
    before = signal.getsignal(signal.SIGTERM)
    guard.install()
    guard.hold()
    os.kill(os.getpid(), signal.SIGTERM)  # recorded, not raised
    time.sleep(0.01)
    with pytest.raises(signals.SignalExit):
        guard.release()
    assert signal.getsignal(signal.SIGTERM) == before
    guard.install()
    guard.release()  # nothing received: nothing raised
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_between_the_strategys_teardown_and_lightnings_ends_the_rank_saying_so(caplog) -> None:
    """Lightning's handler (installed for the trainer call) only notes a SIGTERM once its loop has ended; the guard
    gives the signals back to a last handler of its own instead, until Lightning restores the ones it found."""
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose

    noted: list[int] = []
    lightnings = _HandlersCompose([lambda signum, frame: noted.append(signum)])
    original = signal.signal(signal.SIGTERM, lightnings)
    try:
        guard = signals.SignalGuard(lambda: "rank 1", lambda: [])
        guard.install()
        guard.release()
        assert signal.getsignal(signal.SIGTERM) != lightnings
        with caplog.at_level(logging.ERROR), pytest.raises(signals.SignalExit) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert info.value.code == 128 + signal.SIGTERM and not noted
        assert any("rank 1 received SIGTERM after its run ended" in r.getMessage() for r in caplog.records)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler that is not Lightning's comes back as it was
        guard.install()
        guard.release()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, original)


def test_a_launched_rank_that_ended_is_named_with_how_it_ended() -> None:
    import subprocess
    import sys

    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        killed.terminate()
        killed.wait(10)
        failed.wait(10)
        said = signals.ended_children([running, killed, failed])
        assert said == (
            f"the rank process {killed.pid} was ended by SIGTERM; the rank process {failed.pid} exited with status 3"
        )
    finally:
        running.kill()
        running.wait(10)


def test_forked_data_loader_workers_leave_a_private_ledger_alone(monkeypatch) -> None:
    """One local rank's ledger is private memory kept out of forks (MADV_DONTFORK): workers forked after setup
    (every epoch) load batches while the rank trains, and the rank's losses are those of loading in-process."""
    monkeypatch.delenv(SHM_ENV, raising=False)
    losses = []
    for workers in (0, 2):
        torch.manual_seed(0)
        module = TinyLM()
        loader = data(16)
        loader = torch.utils.data.DataLoader(
            loader.dataset, batch_size=2, num_workers=workers, multiprocessing_context="fork" if workers else None
        )
        trainer(max_steps=-1, max_epochs=2).fit(module, loader)
        assert len(module.losses) == 16
        losses.append(module.losses)
    assert losses[0] == losses[1]
