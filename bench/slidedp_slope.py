"""SlideDP's host-memory slope alone: the SlideDP runs of the "systems" plan, one job per model size.

Usage: ``python -m bench.slidedp_slope OUT [--scale cpu] [--ranks 2] [--knob name=json ...]``

Prints, per size, the training-step host peak (PSS sum over the job's processes), its shared-memory part and
the median step, then the least-squares slope in GB per billion parameters (the systems table's SlideDP row,
without running the other systems). ``--knob`` sets a ``SlideDPStrategy`` argument for every run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bench import configs
from bench.baselines.runner import run_job
from bench.tables import GB, slope


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="results directory")
    p.add_argument("--scale", choices=configs.SCALES, default="cpu")
    p.add_argument("--ranks", type=int, default=None)
    p.add_argument("--knob", action="append", default=[], help="name=value (value as JSON), e.g. chunk_bytes=1048576")
    args = p.parse_args(argv)
    knobs = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.knob)}
    sc = configs.scale(args.scale, args.ranks)
    xs, ys = [], []
    for job in configs.plan(sc, args.out / "init"):
        if not (job.name.startswith("systems/") and job.name.endswith("/slidedp")):
            continue
        runs = [(r.name, dataclasses.replace(r.spec, knobs={**r.spec.knobs, **knobs})) for r in job.runs]
        r = run_job(runs, args.out / job.name)[0]
        if not r.ok:
            print(f"{job.name}: {r.status}: {r.reason}", flush=True)
            return 1
        print(f"{job.name}: {r.spec.model.num_params / 1e6:.1f} M params, host peak {r.host_peak / GB:.3f} GB "
              f"(shared {r.host_peak_shmem / GB:.3f}), step {r.step_median * 1e3:.0f} ms", flush=True)  # fmt: skip
        xs.append(r.spec.model.num_params / 1e9)
        ys.append(r.host_peak / GB)
    b, a = slope(xs, ys)
    print(f"slope {b:.2f} GB per billion parameters, intercept {a:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
