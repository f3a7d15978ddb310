"""SlideDP's host-memory slope alone: the SlideDP runs of the "systems" plan, one job per model size.

Usage: ``python -m bench.slidedp_slope OUT [--scale cpu] [--ranks 2] [--depths 3,4,6] [--knob name=json ...]``

Prints, per size, the training-step host peak (PSS sum over the job's processes), its shared-memory part, the
memory the ledger holds after the steps (``engine.ledger_stats()``), the ranks' exact private peak (kernel
high-water mark, see ``bench.baselines.record``) and the median step, then the least-squares slopes in GB per
billion parameters (the systems table's SlideDP row, without running the other systems). ``--knob`` sets a
``SlideDPStrategy`` argument for every run (or ``loss_chunk``, see ``bench.baselines.slidedp``); ``--depths``
replaces the sizes by the first size's shape at these block counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bench import configs
from bench.baselines.runner import run_job
from bench.fit import slope
from bench.tables import GB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="results directory")
    p.add_argument("--scale", choices=configs.SCALES, default="cpu")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--knob", action="append", default=[], help="name=value (value as JSON), e.g. chunk_bytes=1048576")
    p.add_argument("--depths", default=None, help="comma-separated block counts of the first size's shape")
    args = p.parse_args(argv)
    knobs = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.knob)}
    sc = configs.scale(args.scale, args.ranks)
    if args.depths:
        base = sc.slope_shapes[0]
        stem = base.name.rsplit("-L", 1)[0]
        shapes = tuple(dataclasses.replace(base, name=f"{stem}-L{n}", layers=int(n)) for n in args.depths.split(","))
        sc = dataclasses.replace(sc, slope_shapes=shapes)
    xs, ys, ledger, private = [], [], [], []
    for job in configs.plan(sc, args.out / "init"):
        if not (job.name.startswith("systems/") and job.name.endswith("/slidedp")):
            continue
        runs = [(r.name, dataclasses.replace(r.spec, knobs={**r.spec.knobs, **knobs})) for r in job.runs]
        r = run_job(runs, args.out / job.name)[0]
        if not r.ok:
            print(f"{job.name}: {r.status}: {r.reason}", flush=True)
            return 1
        exact = r.private_peak / GB if r.private_peak is not None else float("nan")
        held = r.ledger_host_bytes / GB if r.ledger_host_bytes is not None else float("nan")
        print(
            f"{job.name}: {r.spec.model.num_params / 1e6:.1f} M params, host peak {r.host_peak / GB:.3f} GB "
            f"(shared {r.host_peak_shmem / GB:.3f}), ledger {held:.3f} GB, ranks' exact private peak "
            f"{exact:.3f} GB, step {r.step_median * 1e3:.0f} ms",
            flush=True,
        )
        xs.append(r.spec.model.num_params / 1e9)
        ys.append(r.host_peak / GB)
        ledger.append(held)
        private.append(exact)
    b, a = slope(xs, ys)
    print(f"slope {b:.2f} GB per billion parameters, intercept {a:.3f} GB")
    print(f"slope of the ledger alone: {slope(xs, ledger)[0]:.3f} GB per billion parameters")
    print(f"slope of the exact private peak alone: {slope(xs, private)[0]:.2f} GB per billion parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
