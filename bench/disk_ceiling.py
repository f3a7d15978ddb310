"""The disk ceiling of optimizer state kept on a local disk: sequential write and read throughput of a directory with
the state file's own I/O (an unnamed, reserved file; direct I/O; several requests in flight), the way
``cpu_ops.adam_shaped_copy`` gives the memory-bandwidth ceiling of the update::

    python -m bench.disk_ceiling --dir /local/ssd [--gib 2] [--chunk-mib 8] [--depth 4] [--stream [--optimizer-state int8]]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import numpy as np

from slidedp_lightning.constants import MASTER_BYTES, OPTIMIZER_STATES, QUANT_BLOCK, moment_bytes
from slidedp_lightning.runtime.ledger.disk import (
    DISK_STATE,
    PIECE_BYTES,
    DiskCeiling,
    DiskLayout,
    RecordStream,
    StateFile,
    measure_ceiling,
)
from slidedp_lightning.runtime.ledger.geometry import LedgerGeometry


def measure_stream(
    directory: str,
    nbytes: int,
    units: int = 16,
    buffers: int = 4,
    threads: int = 2,
    optimizer_state: str = "fp32",
    piece_bytes: int = PIECE_BYTES,
) -> dict:
    """A timed pass of AdamW over ``units`` equal units whose master and moments fill ``nbytes`` of a state file
    (``fp32``: 12 B/param; ``int8``: the FP32 master, the moments' codes and their block scales, about 6 B/param),
    after an untimed one: each record (a unit's state, in pieces of at most ``PIECE_BYTES``) acquired, the next one
    read ahead while it is updated, and written behind (:class:`RecordStream`), the update lane's kernel on one
    thread. Seconds, bytes read and written, and Gparam/s."""
    from cpu_ops import adamw8_update, adamw_update, set_kernel_threads

    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_state must be one of {OPTIMIZER_STATES}, got {optimizer_state!r}")
    set_kernel_threads(1)
    per_param = MASTER_BYTES + 2 * moment_bytes(optimizer_state)
    per_unit = max(int(nbytes / units / per_param) // QUANT_BLOCK, 1) * QUANT_BLOCK
    geometry = LedgerGeometry(total=per_unit * units, num_units=units, world_size=1, staging_slots=0,
                              staging_elems=0, staging_itemsize=4, unit_sizes=(per_unit,) * units,
                              optimizer_state=optimizer_state)  # fmt: skip
    layout = DiskLayout(geometry, DISK_STATE["master_and_moments"], piece_bytes)
    records = [(u, p) for u in range(units) for p in range(len(layout.pieces(u, 0)))]
    state = StateFile.create(directory, layout.nbytes, share=False)
    stream = RecordStream(state, layout, owner=0, buffers=buffers, threads=threads)
    grad = np.random.default_rng(0).standard_normal(layout.piece_elems, dtype=np.float32) * np.float32(1e-3)
    lr, beta1, beta2, eps, weight_decay = 1e-5, 0.9, 0.999, 1e-8, 0.01

    def update(v: dict[str, np.ndarray], step: int) -> None:
        n = v["master"].shape[0]
        if optimizer_state == "fp32":
            adamw_update(v["master"], v["exp_avg"], v["exp_avg_sq"], grad[:n], step=step, lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, weight_decay=weight_decay)  # fmt: skip
        else:
            adamw8_update(v["master"], v["exp_avg"], v["exp_avg_sq"], v["exp_avg_absmax"], v["exp_avg_sq_absmax"],
                          grad[:n], segments=np.array([[0, n, 0]], dtype=np.int64),
                          hyper=[(lr, beta1, beta2, eps, weight_decay, True)], step=step)  # fmt: skip

    def one_pass(step: int) -> float:
        t0 = time.perf_counter()
        stream.prefetch(*records[0])
        for i, key in enumerate(records):  # as the update lane: the record, then a read ahead of the next one
            views = stream.acquire(*key)
            if i + 1 < len(records):
                stream.prefetch(*records[i + 1])
            update(views, step)
            stream.release(*key)
        stream.flush()
        return time.perf_counter() - t0

    try:
        one_pass(1)  # untimed: compiles the kernel and writes every record (a never-written block reads for free)
        stream.read_bytes = stream.written_bytes = 0
        seconds = one_pass(2)
        return {"seconds": seconds, "read_bytes": stream.read_bytes, "written_bytes": stream.written_bytes,
                "gparam_s": per_unit * units / seconds / 1e9, "units": units, "records": len(records),
                "state_bytes": layout.nbytes, "buffers": buffers, "optimizer_state": optimizer_state}  # fmt: skip
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
    parser.add_argument("--stream", action="store_true", help="also time the update streaming its state")
    parser.add_argument("--optimizer-state", default="fp32", choices=OPTIMIZER_STATES, help="the streamed moments")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30))
    c = measure_ceiling(args.dir, nbytes, args.chunk_mib << 20, args.depth)
    result: dict = {**c.__dict__}
    if args.stream:
        result["stream"] = measure_stream(args.dir, nbytes, optimizer_state=args.optimizer_state)
        result["stream"]["of_ceiling"] = stream_vs_ceiling(result["stream"], c)
    if args.json:
        print(json.dumps(result))
        return 0
    io = "direct" if c.direct else "buffered (no direct I/O here)"
    print(f"{c.directory}: write {c.write_gbps:.2f} GB/s, read {c.read_gbps:.2f} GB/s, both {c.mixed_gbps:.2f} GB/s "
          f"({c.nbytes / 2**30:.1f} GiB, {c.chunk_bytes >> 20} MiB x {c.depth} in flight, {io})")  # fmt: skip
    if args.stream:
        s = result["stream"]
        moments = "FP32" if s["optimizer_state"] == "fp32" else "8-bit"
        print(f"update streaming its FP32 master and {moments} moments ({s['units']} units in {s['records']} "
              f"records, {s['buffers']} buffers): "
              f"{s['gparam_s']:.3f} Gparam/s, {s['of_ceiling']:.2f} of the disk's ceiling")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
