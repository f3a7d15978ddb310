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

from slidedp_lightning.runtime.ledger.disk import measure_ceiling


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    parser.add_argument("--gib", type=float, default=2.0, help="bytes written then read (GiB)")
    parser.add_argument("--chunk-mib", type=int, default=8, help="bytes per request (MiB)")
    parser.add_argument("--depth", type=int, default=4, help="requests in flight")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    c = measure_ceiling(args.dir, int(args.gib * (1 << 30)), args.chunk_mib << 20, args.depth)
    if args.json:
        print(json.dumps(c.__dict__))
    else:
        io = "direct" if c.direct else "buffered (no direct I/O here)"
        print(f"{c.directory}: write {c.write_gbps:.2f} GB/s, read {c.read_gbps:.2f} GB/s "
              f"({c.nbytes / 2**30:.1f} GiB, {c.chunk_bytes >> 20} MiB x {c.depth} in flight, {io})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
