"""cpu_ops.threads: core counting, per-rank budgets, Numba thread setting."""

from __future__ import annotations

import os

import numba
import pytest

from cpu_ops import logical_cpus, physical_cores, set_kernel_threads, thread_budget, threads

SMT_CPUINFO = "\n\n".join(
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\nflags\t\t: fpu" for cpu in range(4)
)  # 4 logical CPUs, 2 cores with 2 hyperthreads each


def test_physical_cores_sane() -> None:
    cores = physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)


def test_logical_cpus_follow_the_affinity(monkeypatch) -> None:
    assert physical_cores() <= logical_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "_allowed_cpus", lambda: None)  # no affinity API: every CPU of the machine
    assert logical_cpus() == (os.cpu_count() or 1)


def test_count_physical_cores_smt_and_affinity() -> None:
    assert threads.count_physical_cores(SMT_CPUINFO, None) == 2
    assert threads.count_physical_cores(SMT_CPUINFO, {0, 1, 2, 3}) == 2
    assert threads.count_physical_cores(SMT_CPUINFO, {0, 2}) == 1  # siblings of one core
    assert threads.count_physical_cores(SMT_CPUINFO, {0, 1}) == 2
    assert threads.count_physical_cores("processor\t: 0\n", {0}) is None  # no core ids
    assert threads.count_physical_cores(SMT_CPUINFO, {7}) is None  # CPU not listed


@pytest.mark.parametrize(("cores", "ranks", "expected"), [(2, 2, 1), (2, 1, 2), (2, 4, 1), (16, 3, 5)])
def test_thread_budget(monkeypatch: pytest.MonkeyPatch, cores: int, ranks: int, expected: int) -> None:
    monkeypatch.setattr(threads, "physical_cores", lambda: cores)
    assert thread_budget(ranks) == expected


def test_thread_budget_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "physical_cores", lambda: 2)
    assert thread_budget(2, override=3) == 3
    with pytest.raises(ValueError, match="override .* must be >= 1, got 0"):
        thread_budget(2, override=0)
    with pytest.raises(ValueError, match="must be >= 1, got -1"):
        thread_budget(2, override=-1)
    with pytest.raises(TypeError, match="override .* must be an int"):
        thread_budget(2, override=1.5)
    with pytest.raises(ValueError, match="local_world_size must be >= 1"):
        thread_budget(0)


def test_set_kernel_threads() -> None:
    before = numba.get_num_threads()
    try:
        set_kernel_threads(1)
        assert numba.get_num_threads() == 1
        set_kernel_threads(10_000)
        assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS
        with pytest.raises(ValueError, match="must be >= 1"):
            set_kernel_threads(0)
    finally:
        numba.set_num_threads(before)


KERNEL_ON_MAIN = """
import sys, numpy as np, torch, cpu_ops
(torch.randn(1 << 20) * 2).sum()  # as a job builds its model: torch's OpenMP team at 2 threads
torch.set_num_threads(1)  # then the launcher's share of the cores
if sys.argv[1] == "pool-started-aside":
    cpu_ops.start_kernel_pool()
cpu_ops.set_kernel_threads(1)
cpu_ops.sum_squares(np.ones(4096, np.float32))  # a parallel kernel on this (the training) thread
print(torch.get_num_threads())
"""


@pytest.mark.parametrize("case", ["pool-started-aside", "pool-started-here"])
def test_a_kernel_on_the_training_thread_keeps_its_torch_threads_once_the_pool_started_aside(case) -> None:
    """Numba's OpenMP layer resets the thread count of the thread that starts its pool once torch's OpenMP team
    ran there; torch's ops on that thread read it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", KERNEL_ON_MAIN, case], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    # started here, the pool takes this thread's torch ops to NUMBA_NUM_THREADS: why the engine starts it aside
    assert int(out.stdout) == (1 if case == "pool-started-aside" else 2)
