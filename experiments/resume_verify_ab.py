"""The cost of checking a distributed checkpoint's files at resume (XXH3-64 per file, docs/checkpoints.md), side by
side: a 2-rank CPU SlideDP job loads one checkpoint ``--rounds`` times with the check and as many as a resume did
before checksums (the checksums left out of the metadata it reads, and DCP's ``.metadata`` read again by each check
that needs it, as it was then), alternating which goes first in each round, and prints the medians and their ratio.

Each rank holds a Qwen3 model in one shared ledger (gloo group, ``Topology.build``); rank 0 fills the ledger with
random values, the job saves it once, and every load is timed on rank 0 from a barrier to a barrier (the whole
``checkpoint.load``: metadata, checks, DCP's read into the ledger). Every load is checked bit for bit against the
saved ledger. ``--cold`` drops the checkpoint's files from the page cache before each load
(``posix_fadvise(DONTNEED)``, no root needed), so that each load reads from the disk; otherwise they stay cached.

Usage: ``python experiments/resume_verify_ab.py [--hidden 512] [--layers 6] [--vocab 32000] [--rounds 7] [--cold]
[--dir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM(config)


def drop_from_cache(path: Path) -> None:
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    from slidedp_lightning.checkpoints import distributed as checkpoint
    from slidedp_lightning.checkpoints import files as checkpoint_files
    from slidedp_lightning.runtime import compat
    from slidedp_lightning.runtime.engine import EngineConfig, SlideDPEngine
    from slidedp_lightning.runtime.topology import Topology

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    topology = Topology.build(global_rank=rank, local_rank=rank, ranks_per_host=2)
    model = build_model(args)
    engine = SlideDPEngine(
        model, EngineConfig(), device=torch.device("cpu"), compute_dtype=torch.float32, topology=topology
    )
    read_meta = checkpoint.read_meta

    def unchecked_meta(path):  # the metadata of a save that recorded no checksums: nothing is verified
        meta = read_meta(path)
        for key in (checkpoint_files.CHECKSUMS, checkpoint_files.PIECES):
            meta["slidedp"].pop(key, None)
        return meta

    reader_class = compat.CheckedFileSystemReader
    read_once = reader_class.read_metadata

    def read_each_time(self, *args, **kwargs):  # no metadata kept by the reader: each check reads it again
        self._metadata.clear()
        return read_once(self, *args, **kwargs)

    try:
        engine.attach_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        views = engine.state.ledger_tensors(list(engine.state.named_slots()), writing=True)
        if rank == 0:
            generator = torch.Generator().manual_seed(1)
            for v in views.values():
                v.copy_(torch.randn(v.shape, generator=generator))
        dist.barrier()
        saved = {k: v.clone() for k, v in views.items()}
        path = Path(args.dir) / "ck"
        checkpoint.save(engine, {}, path)
        nbytes = sum(f.stat().st_size for f in path.iterdir())
        times: dict[str, list[float]] = {"with": [], "without": []}
        cpu: dict[str, list[float]] = {"with": [], "without": []}  # CPU seconds of both ranks (every thread)
        for i in range(args.rounds):
            for case in ("with", "without") if i % 2 == 0 else ("without", "with"):
                checkpoint.read_meta = read_meta if case == "with" else unchecked_meta  # type: ignore[assignment]
                reader_class.read_metadata = read_once if case == "with" else read_each_time  # type: ignore[method-assign]
                if rank == 0:  # the ledger is shared: one rank clears it
                    for v in views.values():
                        v.zero_()
                    if args.cold:
                        drop_from_cache(path)
                dist.barrier()
                t0, c0 = time.perf_counter(), cpu_seconds()
                checkpoint.load(engine, path)
                dist.barrier()
                times[case].append(time.perf_counter() - t0)
                spent = [0.0, 0.0]
                dist.all_gather_object(spent, cpu_seconds() - c0)
                cpu[case].append(sum(spent))
                if rank == 0:
                    assert all(torch.equal(v, saved[k]) for k, v in views.items()), "a load is not bit-exact"
                dist.barrier()
        checkpoint.read_meta = read_meta  # type: ignore[assignment]
        reader_class.read_metadata = read_once  # type: ignore[method-assign]
        t0 = time.perf_counter()
        checkpoint_files.sums(sorted(path.glob("*.distcp")))
        hash_alone = time.perf_counter() - t0
        if rank == 0:
            params = sum(p.numel() for p in model.parameters())
            result = {"times": times, "cpu": cpu, "bytes": nbytes, "params": params, "hash": hash_alone}
            Path(out).write_text(json.dumps(result))
    finally:
        engine.close(restore=False)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each load")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (a disk, not a tmpfs)")
    args = parser.parse_args(argv)
    args.dir = args.dir or tempfile.mkdtemp(prefix="resume_verify-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(args.dir) / "result.json")
    mp.spawn(rank_main, args=(port, args, out), nprocs=2)
    r = json.loads(Path(out).read_text())
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    print(
        f"{r['params'] / 1e6:.1f} M params, checkpoint {r['bytes'] / 2**20:.0f} MiB, 2 ranks, "
        f"{'cold' if args.cold else 'warm'} page cache, {args.rounds} loads each"
    )
    for case in ("without", "with"):
        print(
            f"  load {case:7s} the check: median {med[case]:.3f} s  ({', '.join(f'{t:.3f}' for t in r['times'][case])})"
        )
    paired = statistics.median(w / o for w, o in zip(r["times"]["with"], r["times"]["without"]))
    print(f"  ratio with/without: {med['with'] / med['without']:.3f} (of the medians), {paired:.3f} (median per round)")
    cpu = {k: statistics.median(v) for k, v in r["cpu"].items()}
    print(f"  CPU seconds per load, both ranks: median {cpu['without']:.3f} without, {cpu['with']:.3f} with the check")
    print(f"  hashing every .distcp file on one rank alone: {r['hash']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
