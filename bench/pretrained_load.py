"""Loading a pretrained checkpoint into the ledger: read throughput and the ranks' private memory.

Usage::

    python -m bench.pretrained_load make DIR            # a ~268M-parameter BF16 Qwen3 checkpoint (random weights)
    python -m bench.pretrained_load read DIR --ranks 2  # sequential safe_open + float() of every tensor (each rank
                                                        # its half of the tensors), the reference read; --fresh:
                                                        # converted into one new FP32 buffer instead
    python -m bench.pretrained_load load DIR --ranks 2 --mode new|naive|meta
    python -m bench.pretrained_load all DIR --repeat 3  # every case above once per round, medians over the rounds
    python -m bench.pretrained_load throughput DIR --iterations 7  # ledger fill vs reference read, alternating

``load`` builds a SlideDP engine (CPU, FP32, full/gpu_reduce) over ``--ranks`` processes on one host: ``new`` loads
with ``slidedp_lightning.from_pretrained`` (the checkpoint read into the ledger by every rank), ``naive`` with
transformers' ``from_pretrained`` on every rank (local rank 0's copy goes in), ``meta`` builds the model on the meta
device and initializes it randomly unit by unit (``meta_init``). Throughput: checkpoint bytes on disk / seconds of the
slowest rank's reading (the fill of the ledger, for ``new``). Private memory: each rank's peak ``RssAnon``
(``/proc/self/status``, sampled every 2 ms from before the model is built until the engine is ready; the ledger is
shared memory and the mapped files are page cache, neither is private), summed over the ranks, with the kernel's
high-water mark less file and shared pages at the end (``bench.baselines.record``'s measure) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

GB = 1e9


def make(directory: Path, hidden: int = 1024, layers: int = 16, shard: str = "200MB") -> int:
    """A random BF16 Qwen3 (``hidden`` wide, intermediate 3x, heads of 64, vocab 32000, untied) saved in safetensors
    shards of at most ``shard``; returns its parameter count (268 M at the defaults)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        head_dim=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size=shard)
    count = sum(p.numel() for p in model.parameters())
    print(f"{count:,} parameters written to {directory}")
    return count


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = (line.partition(":") for line in f)
        keys = ("VmHWM", "RssAnon", "RssFile", "RssShmem")
        return {k: int(v.split()[0]) * 1024 for k, _, v in fields if k in keys}


class AnonPeak(threading.Thread):
    """The peak of this process's RssAnon, sampled every ``interval`` seconds until stopped."""

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self._done = interval, 0, threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _status()["RssAnon"])
            time.sleep(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        self.peak = max(self.peak, _status()["RssAnon"])
        return self.peak


def _meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        fields = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)}
    return {"used": fields["MemTotal"] - fields["MemAvailable"], "shmem": fields["Shmem"]}


class HostPeak(threading.Thread):
    """Peaks of the host's used memory (MemTotal - MemAvailable) and of its shared memory (Shmem) above their values
    at the start, sampled every 10 ms until stopped (the whole host: other jobs on it count too)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = _meminfo()
        self.peak = dict.fromkeys(self.base, 0)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            now = _meminfo()
            self.peak = {k: max(self.peak[k], now[k] - self.base[k]) for k in now}
            time.sleep(0.01)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def _checkpoint_tensors(directory: Path) -> list[tuple[str, str, int]]:
    """(file, key, bytes) of every tensor of the checkpoint."""
    from slidedp_lightning.runtime.ledger.weight_source import scan_safetensors

    return [(t.file, t.key, t.numel * t.itemsize) for t in scan_safetensors(str(directory)).values()]


def _reference_read(tensors: list[tuple[str, str, int]], mine: list[int], keep: bool, trim: bool = False) -> float:
    """Seconds to read tensors ``mine`` with ``safe_open`` + ``float()``, as transformers loads them: each into a new
    FP32 tensor, kept until the end (``keep``) or dropped at once (its heap blocks reused by the next one); ``trim``:
    the heap's free memory given back to the OS first, so that the new tensors get new pages as in a fresh process
    (else they reuse the pages the previous iteration's tensors left in the heap)."""
    from safetensors import safe_open

    from slidedp_lightning.runtime.host_os import trim_host_heap

    if trim:
        trim_host_heap()
    t0 = time.perf_counter()
    handles: dict = {}
    kept: list = []
    for i in mine:
        file, key, _ = tensors[i]
        handle = handles.get(file) or handles.setdefault(file, safe_open(file, "pt"))
        value = handle.get_tensor(key).float()
        if keep:
            kept.append(value)
        del value
    seconds = time.perf_counter() - t0
    del kept
    return seconds


def alternate(args: argparse.Namespace, rank: int, ranks: int) -> dict:
    """Throughput, side by side: ``--iterations`` times, the ranks load the checkpoint into a new ledger
    (``open_ledger``: every rank reads its share of the units) with the mapped-file fused conversion (``fill``) and
    with the earlier path (``fill_sliced``: safe_open slices converted by torch), and then each reads its half of
    the tensors with ``safe_open`` + ``float()``, the FP32 tensors kept into new pages (``read_new``), kept in the
    heap the previous iteration left (``read_kept``) and dropped one by one (``read_dropped``); seconds per
    iteration of each (and CPU seconds, ``<case>_cpu``)."""
    import torch
    import torch.distributed as dist

    import slidedp_lightning
    from slidedp_lightning.hf.pretrained import loading_into_ledger
    from slidedp_lightning.models import adapter_for
    from slidedp_lightning.runtime import EngineConfig, Topology
    from slidedp_lightning.runtime.layout import build_layout
    from slidedp_lightning.runtime.ledger import initial_weights
    from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights, balanced_shares
    from slidedp_lightning.runtime.ledger.opening import ledger_geometry, open_ledger
    from slidedp_lightning.runtime.ledger.weight_source import SafetensorsWeights

    with loading_into_ledger():
        model = slidedp_lightning.from_pretrained(args.dir)
    topology = Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=ranks)
    adapter = adapter_for(model)
    layout = build_layout(model, adapter.units(model), topology.shard_world, topology.owners)
    geometry = ledger_geometry(layout, EngineConfig(), topology, torch.float32)
    weights = InitialWeights(model, adapter, layout, topology)
    tensors = _checkpoint_tensors(args.dir)
    mine = balanced_shares([n for _, _, n in tensors], ranks)[rank]
    mapped, prepare = SafetensorsWeights._mapped, initial_weights.prepare_pages
    cases = ("fill", "fill_unprepared", "fill_sliced", "read_new", "read_kept", "read_dropped")
    times: dict[str, list[float]] = {name: [] for c in cases for name in (c, f"{c}_cpu")}
    for i in range(args.iterations):
        for case in cases if i % 2 == 0 else reversed(cases):  # none always first
            if ranks > 1:
                dist.barrier()
            cpu = _cpu_seconds()
            if case.startswith("fill"):
                if case == "fill_sliced":  # the earlier path: safe_open slices, torch's conversions
                    SafetensorsWeights._mapped = lambda self, t: None  # type: ignore[method-assign]
                if case != "fill":  # the pages left to the writes
                    initial_weights.prepare_pages = lambda *a: False
                ledger = open_ledger(geometry, layout.num_params, weights, topology)
                SafetensorsWeights._mapped, initial_weights.prepare_pages = mapped, prepare  # type: ignore[method-assign]
                assert weights.report is not None
                times[case].append(weights.report.seconds)
                ledger.close()
            else:
                times[case].append(_reference_read(tensors, mine, keep=case != "read_dropped", trim=case == "read_new"))
            times[f"{case}_cpu"].append(_cpu_seconds() - cpu)
    return times


def _cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread (user + system: the page faults are system time)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(args: argparse.Namespace) -> None:
    """One rank of a ``read`` or ``load`` run; writes ``rank{r}.json`` into ``args.out``."""
    import torch
    import torch.distributed as dist

    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    if ranks > 1:
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark restarts here, after the imports
        f.write("5")
    base = _status()["RssAnon"]
    sampler = AnonPeak()
    sampler.start()
    result: dict = {"rank": rank}
    if args.command == "alternate":
        result.update(alternate(args, rank, ranks))
    elif args.command == "read":
        from safetensors import safe_open

        from slidedp_lightning.runtime.ledger.initial_weights import balanced_shares
        from slidedp_lightning.runtime.ledger.weight_source import scan_safetensors

        tensors = _checkpoint_tensors(args.dir)
        numel = [t.numel for t in scan_safetensors(str(args.dir)).values()]
        mine = balanced_shares([n for _, _, n in tensors], ranks)[rank]
        if ranks > 1:
            dist.barrier()
        fresh = torch.empty(sum(numel[i] for i in mine)) if args.fresh else None  # untouched pages
        t0 = time.perf_counter()
        nbytes, pos = 0, 0
        handles: dict = {}
        for i in mine:
            file, key, n = tensors[i]
            handle = handles.get(file) or handles.setdefault(file, safe_open(file, "pt"))
            if fresh is None:
                value = handle.get_tensor(key).float()
                del value
            else:
                fresh[pos : pos + numel[i]].copy_(handle.get_tensor(key).reshape(-1))
                pos += numel[i]
            nbytes += n
        result.update(seconds=time.perf_counter() - t0, nbytes=nbytes)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        import slidedp_lightning
        from slidedp_lightning.hf.pretrained import loading_into_ledger
        from slidedp_lightning.runtime import EngineConfig, SlideDPEngine, Topology
        from slidedp_lightning.runtime.ledger.initial_weights import InitialWeights

        reports: list = []
        for name in ("load", "fill"):
            original = getattr(InitialWeights, name)

            def kept(self, ledger, _original=original):
                _original(self, ledger)
                reports.append(self.report)

            setattr(InitialWeights, name, kept)
        t0 = time.perf_counter()
        if args.mode == "new":
            with loading_into_ledger():
                model = slidedp_lightning.from_pretrained(args.dir)
        elif args.mode == "naive":
            model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(args.dir, local_files_only=True)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        built = time.perf_counter() - t0
        topology = Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=ranks)
        engine = SlideDPEngine(
            model, EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32, topology=topology
        )
        result.update(build_s=built, setup_s=time.perf_counter() - t0)
        if reports:
            result.update(seconds=reports[0].seconds, nbytes=reports[0].nbytes, kind=reports[0].kind)
        engine.close(restore=False)
    status = _status()
    result.update(
        anon_peak=sampler.stop(),
        anon_base=base,
        hwm_private=status["VmHWM"] - status["RssFile"] - status["RssShmem"],
    )
    if ranks > 1:
        dist.barrier()
        dist.destroy_process_group()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


def run(
    command: str,
    directory: Path,
    ranks: int,
    mode: str = "",
    fresh: bool = False,
    iterations: int = 1,
    timeout: float = 1800,
) -> dict:
    """One run over ``ranks`` processes; the ranks' results combined."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(ranks)}
        cmd = [sys.executable, "-m", "bench.pretrained_load", "_worker", str(directory), "--out", out, "--job", command]
        cmd += ["--iterations", str(iterations)]
        procs = [
            subprocess.Popen(
                cmd + (["--mode", mode] if mode else []) + (["--fresh"] if fresh else []), env={**env, "RANK": str(r)}
            )
            for r in range(ranks)
        ]
        host = HostPeak()
        host.start()
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"{command} {mode} x{ranks} did not finish within {timeout} s") from None
        finally:
            host_peak = host.stop()
        if any(codes):
            raise RuntimeError(f"{command} {mode} x{ranks} failed: exit codes {codes}")
        results = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
    disk = sum(n for _, _, n in _checkpoint_tensors(directory))
    if command == "alternate":  # per iteration: GB/s of the slowest rank; CPU seconds summed over the ranks
        names = ("fill", "fill_unprepared", "fill_sliced", "read_new", "read_kept", "read_dropped")
        speeds = {case: [disk / GB / max(r[case][i] for r in results) for i in range(iterations)] for case in names}
        speeds |= {f"{c}_cpu": [sum(r[f"{c}_cpu"][i] for r in results) for i in range(iterations)] for c in names}
        return speeds
    combined = {
        "anon_peak_sum": sum(r["anon_peak"] for r in results),
        "anon_growth_sum": sum(r["anon_peak"] - r["anon_base"] for r in results),
        "hwm_private_sum": sum(r["hwm_private"] for r in results),
        "setup_s": max(r.get("setup_s", 0.0) for r in results),
        "anon_peak_per_rank": [r["anon_peak"] for r in results],
        "host_used_peak": host_peak["used"],
        "host_shmem_peak": host_peak["shmem"],
    }
    if command == "read" or mode == "new":
        seconds = max(r["seconds"] for r in results)
        combined.update(seconds=seconds, gbps=disk / GB / seconds)
    elif mode == "meta":
        combined.update(seconds=results[0]["seconds"])
    return combined


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("make", "read", "load", "all", "throughput", "_worker"))
    p.add_argument("dir", type=Path)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--mode", choices=("new", "naive", "meta"), default="new")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--job", choices=("read", "load", "alternate"), default="load")
    p.add_argument("--iterations", type=int, default=7, help="throughput: loads (and reference reads) per run")
    p.add_argument("--rank-counts", type=int, nargs="+", default=[1, 2], help="throughput: local ranks per run")
    p.add_argument("--fresh", action="store_true", help="read: convert into one new FP32 buffer (first-touch pages)")
    args = p.parse_args(argv)
    if args.command == "make":
        make(args.dir)
        return 0
    if args.command == "_worker":
        args.command = args.job
        worker(args)
        return 0
    if args.command == "throughput":
        disk = sum(n for _, _, n in _checkpoint_tensors(args.dir))
        print(f"checkpoint {args.dir}: {disk / GB:.3f} GB on disk; medians of {args.iterations} alternating runs")
        for ranks in args.rank_counts:
            got = run("alternate", args.dir, ranks, iterations=args.iterations)
            med = {case: statistics.median(v) for case, v in got.items()}  # GB/s, or CPU seconds (_cpu)

            def ratio(a: str, b: str, got: dict = got) -> float:
                return statistics.median(x / y for x, y in zip(got[a], got[b]))

            print(
                f"x{ranks}: into the ledger {med['fill']:.3f} GB/s (pages left to the writes: "
                f"{med['fill_unprepared']:.3f}; before, safe_open slices: {med['fill_sliced']:.3f}) | safe_open + "
                f"float() into new pages {med['read_new']:.3f} GB/s, kept {med['read_kept']:.3f}, dropped "
                f"{med['read_dropped']:.3f} | ratio per iteration vs new pages {ratio('fill', 'read_new'):.2f} (before "
                f"{ratio('fill_sliced', 'read_new'):.2f}), vs kept {ratio('fill', 'read_kept'):.2f} (before "
                f"{ratio('fill_sliced', 'read_kept'):.2f}), vs "
                f"dropped {ratio('fill', 'read_dropped'):.2f} (before {ratio('fill_sliced', 'read_dropped'):.2f})",
                flush=True,
            )
            names = ("fill", "fill_unprepared", "fill_sliced", "read_new", "read_kept", "read_dropped")
            print(
                "   CPU seconds (all ranks): "
                + ", ".join(f"{c} {statistics.median(got[c + '_cpu']):.2f}" for c in names)
                + f"; CPU ratio vs new pages {ratio('read_new_cpu', 'fill_cpu'):.2f} "
                f"(before {ratio('read_new_cpu', 'fill_sliced_cpu'):.2f})",
                flush=True,
            )
            print("   runs:", json.dumps(got), flush=True)
        return 0
    cases = (
        [("read", 1, "", False), ("read", 2, "", False), ("read", 1, "", True), ("read", 2, "", True)]
        + [
            ("load", 1, "new", False),
            ("load", 2, "new", False),
            ("load", 2, "naive", False),
            ("load", 2, "meta", False),
        ]
        if args.command == "all"
        else [(args.command, args.ranks, args.mode if args.command == "load" else "", args.fresh)]
    )
    disk = sum(n for _, _, n in _checkpoint_tensors(args.dir))
    print(f"checkpoint {args.dir}: {disk / GB:.3f} GB on disk")
    # rounds outside, cases inside: the machine's drift spreads over every case alike
    rounds = [
        [run(command, args.dir, ranks, mode, fresh) for command, ranks, mode, fresh in cases]
        for _ in range(args.repeat)
    ]
    for case, (command, ranks, mode, fresh) in enumerate(cases):
        runs = [r[case] for r in rounds]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "anon_peak_per_rank"}
        label = f"{command} {mode or ('into new buffer' if fresh else 'sequential')} x{ranks}"
        line = f"{label:22s}"
        if "gbps" in median:
            line += f" {median['gbps']:6.3f} GB/s ({median['seconds']:.2f} s)"
        line += (
            f" | private peak sum {median['anon_peak_sum'] / GB:.2f} GB (growth {median['anon_growth_sum'] / GB:.2f}"
            f" GB; VmHWM-file-shmem {median['hwm_private_sum'] / GB:.2f} GB) | host peak: used +"
            f"{median['host_used_peak'] / GB:.2f} GB, shared +{median['host_shmem_peak'] / GB:.2f} GB"
            f" | setup {median['setup_s']:.1f} s"
        )
        print(line, flush=True)
        print("   runs:", json.dumps(runs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
