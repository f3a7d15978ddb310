"""The disk ceiling of optimizer state kept on a local disk: sequential write and read throughput of a directory with
the state file's own I/O (an unnamed, reserved file; direct I/O; several requests in flight), the way
``cpu_ops.adam_shaped_copy`` gives the memory-bandwidth ceiling of the update::

    python -m bench.disk_ceiling --dir /local/ssd [--gib 2] [--chunk-mib 8] [--depth 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

from slidedp_lightning.runtime.ledger.disk import (
    DISK_STATE,
    DiskCeiling,
    DiskLayout,
    RecordStream,
    StateFile,
    measure_ceiling,
)
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry


def measure_stream(directory: str, nbytes: int, units: int = 16, buffers: int = 4, threads: int = 2) -> dict:
    """A timed pass of FP32 AdamW over ``units`` equal units whose master and moments (12 B/param) fill ``nbytes``
    of a state file, after an untimed one, each unit's record read one unit ahead and written behind
    (:class:`RecordStream`), the update on one thread: seconds, bytes read and written, and Gparam/s."""
    from cpu_ops import adamw_update, set_kernel_threads

    set_kernel_threads(1)
    per_unit = max(nbytes // units // 12 // 1024, 1) * 1024
    geometry = LedgerGeometry(total=per_unit * units, num_units=units, world_size=1, staging_slots=0,
                              staging_elems=0, staging_itemsize=4, unit_sizes=(per_unit,) * units)  # fmt: skip
    layout = DiskLayout(geometry, DISK_STATE["master_and_moments"])
    state = StateFile.create(directory, layout.nbytes, share=False)
    stream = RecordStream(state, layout, owner=0, buffers=buffers, threads=threads)
    grad = np.random.default_rng(0).standard_normal(per_unit, dtype=np.float32) * np.float32(1e-3)
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def one_pass(step: int) -> float:
        t0 = time.perf_counter()
        stream.prefetch(0)
        for u in range(units):
            if u + 1 < units:
                stream.prefetch(u + 1)
            v = stream.acquire(u)
            adamw_update(v["master"], v["exp_avg"], v["exp_avg_sq"], grad, step=step, **hyper)
            stream.release(u)
        stream.flush()
        return time.perf_counter() - t0

    try:
        one_pass(1)  # untimed: compiles the kernel and writes every record (a never-written block reads for free)
        stream.read_bytes = stream.written_bytes = 0
        seconds = one_pass(2)
        return {"seconds": seconds, "read_bytes": stream.read_bytes, "written_bytes": stream.written_bytes,
                "gparam_s": per_unit * units / seconds / 1e9, "units": units, "buffers": buffers}  # fmt: skip
    finally:
        stream.close()
        state.close()


def stream_vs_ceiling(stream: dict, ceiling: DiskCeiling) -> float:
    """The streamed update's share of the disk's ceiling: the time its reads and writes take together at the
    measured rate of reads and writes at once, over its time."""
    floor = (stream["read_bytes"] + stream["written_bytes"]) / (ceiling.mixed_gbps * 1e9)
    return floor / stream["seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=2.0, help="bytes written then read (GiB)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="bytes per request (MiB)")
    parser.add_argument("--depth", type=int, default=4, help="requests in flight")
    parser.add_argument("--stream", action="store_true", help="also time the FP32 update streaming its state")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30))
    c = measure_ceiling(args.dir, nbytes, args.chunk_mib << 20, args.depth)
    result: dict = {**c.__dict__}
    if args.stream:
        result["stream"] = measure_stream(args.dir, nbytes)
        result["stream"]["of_ceiling"] = stream_vs_ceiling(result["stream"], c)
    if args.json:
        print(json.dumps(result))
        return 0
    io = "direct" if c.direct else "buffered (no direct I/O here)"
    print(f"{c.directory}: write {c.write_gbps:.2f} GB/s, read {c.read_gbps:.2f} GB/s, both {c.mixed_gbps:.2f} GB/s "
          f"({c.nbytes / 2**30:.1f} GiB, {c.chunk_bytes >> 20} MiB x {c.depth} in flight, {io})")  # fmt: skip
    if args.stream:
        s = result["stream"]
        print(f"FP32 update streaming its master and moments ({s['units']} units, {s['buffers']} buffers): "
              f"{s['gparam_s']:.3f} Gparam/s, {s['of_ceiling']:.2f} of the disk's ceiling")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
