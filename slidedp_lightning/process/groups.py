"""The default process group a SlideDP strategy created, and its destruction at the end of a run.

A process group's native threads (gloo's ``pt_gloo_runloop`` workers and ``gloo_tcp_loop``, NCCL's watchdog, and
on global rank 0 the ``pt_tcpstore_uv`` server of the job's TCPStore) end only when its last reference goes. Left
to interpreter shutdown, a worker that frees the last collective's work object while the interpreter finalizes
aborts the process (``terminate called without an active exception``). So the strategy destroys what it created
when a run ends (``docs/reliability.md``, "Failure handling"), and a later ``fit``/``validate`` in the same process
creates a new group.

Re-creating the group is only safe once the old TCPStore server is gone: a rank that left its teardown early and
connected to the old server (still listening on the same port while global rank 0 tears down) would read the old
group's rendezvous keys and fail to connect. :func:`destroy_default_group` therefore holds every other rank in its
teardown until global rank 0's server has closed its connections.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

log = logging.getLogger(__name__)

# the most a rank waits at the end of a run for global rank 0's store server to go (it goes right after the
# last barrier unless something outside SlideDP keeps a reference to the store)
STORE_CLOSE_WAIT_S = 60.0


@dataclass(frozen=True)
class _Owned:
    group: weakref.ref  # the default group SlideDP created (a weak reference: it must not keep it alive)
    address: str  # where the TCPStore server of its rendezvous listens
    port: int
    rank0_serves: bool  # global rank 0 hosts that server (not torchelastic's agent)


_owned: _Owned | None = None


def claim_default_group(address: str, port: int) -> None:
    """Record that SlideDP just created the default group (rendezvous at ``address:port``)."""
    global _owned
    world = dist.group.WORLD
    assert world is not None, "claim the default group after creating it"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    _owned = _Owned(weakref.ref(world), address, int(port), rank0_serves=not agent_store)


def owns_default_group() -> bool:
    """Whether the current default group is the one SlideDP created (not the user's, not a later one)."""
    return _owned is not None and dist.is_initialized() and _owned.group() is dist.group.WORLD


def destroy_default_group(timeout_s: float, peers_alive: bool = True) -> bool:
    """Destroy the default group if SlideDP created it (every group of the process goes with it); returns whether
    it did.

    ``peers_alive``: the run ended normally on this rank, so every rank comes here: the ranks meet in a barrier
    (no rank still needs the group), then each destroys its group and every rank but global rank 0 waits (at most
    ``min(timeout_s, STORE_CLOSE_WAIT_S)``) until rank 0's store server has closed its connection. After a failure
    (``peers_alive=False``) nothing is destroyed: a collective still in flight on a stuck peer would make the
    destruction wait for the whole process-group timeout; the process is ending anyway.
    """
    global _owned
    if not owns_default_group():
        return False
    assert _owned is not None
    owned, _owned = _owned, None
    if not peers_alive:
        log.debug("SlideDP: after a failure the default process group is left to the process's exit")
        return False
    rank, world_size = dist.get_rank(), dist.get_world_size()
    watch = _watch_store(owned, timeout_s) if world_size > 1 and rank != 0 and owned.rank0_serves else None
    try:
        if world_size > 1:
            dist.all_reduce(torch.zeros(1))  # a barrier on the CPU backend (gloo), whatever the device backend
    except RuntimeError as err:  # a peer went away meanwhile: nothing to wait for
        log.warning("SlideDP: the ranks did not meet before the process group was destroyed: %s", err)
        if watch is not None:
            watch.close()
            watch = None
    dist.destroy_process_group()
    if watch is not None:
        _wait_closed(watch, min(timeout_s, STORE_CLOSE_WAIT_S), owned)
    return True


def _watch_store(owned: _Owned, timeout_s: float) -> socket.socket | None:
    """A plain TCP connection to rank 0's store server, opened while it surely listens (before the barrier); the
    server closes it when it goes."""
    try:
        return socket.create_connection((owned.address, owned.port), timeout=min(timeout_s, STORE_CLOSE_WAIT_S))
    except OSError as err:
        log.debug("SlideDP: cannot watch the store at %s:%d (%s)", owned.address, owned.port, err)
        return None


def _wait_closed(sock: socket.socket, wait_s: float, owned: _Owned) -> None:
    started = time.monotonic()
    try:
        sock.settimeout(max(wait_s, 0.001))
        while sock.recv(4096):  # the server never sends to a client that never asked; EOF = it closed
            pass
    except TimeoutError:
        log.warning(
            "SlideDP: global rank 0's TCPStore server at %s:%d was still up %.0f s after the process group was "
            "destroyed (something keeps a reference to the store?); a later fit in this process may fail to "
            "connect.",
            owned.address,
            owned.port,
            time.monotonic() - started,
        )
    except OSError:  # reset by the closing server: it is gone
        pass
    finally:
        sock.close()


def backend_for(device: torch.device, requested: str | None = None) -> str:
    """The process group backend: on CUDA, NCCL for device tensors and gloo for the host tensors that the runtime
    also reduces (replicated route, deferred-update norms and flags, route and AutoPolicy probes, multi-host);
    on CPU, gloo. A requested backend without a CPU mapping gets gloo added for host tensors."""
    backend = requested or _get_default_process_group_backend_for_device(device)
    if device.type != "cuda" or "cpu:" in backend or backend == "gloo":
        return backend
    combined = f"cpu:gloo,cuda:{backend.split(':')[-1]}"
    if requested:
        log.info(
            "SlideDP: process group backend %r has no CPU mapping; using %r (the runtime also reduces host tensors)",
            requested,
            combined,
        )
    return combined


def check_host_backend() -> None:
    """A default process group made before SlideDP's setup (by the user) must also reduce host tensors, as
    :func:`backend_for`'s do: the runtime all-reduces CPU tensors (deferred-update norms and flags, route and
    AutoPolicy probes, multi-host ledgers). Raises, naming the fix, when it has no CPU backend (NCCL alone)."""
    config = dist.get_backend_config()
    if "cpu:" not in config:
        raise ValueError(
            f"SlideDP: the process group initialized before the strategy's setup has backend {config!r}, which "
            "cannot reduce the host tensors the runtime also reduces. Initialize it with "
            "torch.distributed.init_process_group(backend='cpu:gloo,cuda:nccl'), or leave it to SlideDPStrategy."
        )
