"""Private memory of a resume from a distributed checkpoint next to a fresh start from the same pretrained model.

Three 2-rank CPU jobs of ``tests/integration/job.py`` (FP32, the model read with ``slidedp_lightning.from_pretrained``):
one step and a distributed checkpoint; a fresh start (one step, nothing resumed); ``fit(ckpt_path=...)`` from that
checkpoint. Each rank records its peak ``RssAnon`` from the start of ``fit`` to ``on_train_start`` (the ledger
filled and, when resuming, the checkpoint restored). The resume may hold at most max(300 MB, 25 % of one FP32
model) more private memory than the fresh start, summed over the ranks.

Usage: ``python experiments/resume_memory.py PRETRAINED_DIR [--out DIR]`` (``python -m bench.pretrained_load make
DIR`` writes a 266.9 M-parameter checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import run_job  # noqa: E402

GB = 1e9


def peaks(out: Path, ranks: int = 2) -> list[int]:
    return [json.loads((out / f"memory_rank{r}.json").read_text())["anon_peak"] for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pretrained", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="resume_memory-"))
    common = dict(strategy="slidedp", devices=2, tied=False, batch=1, pretrained=str(args.pretrained))
    jobs = {
        "first": dict(steps=1, save_at=1),
        "fresh": dict(steps=1, record_memory=True),
        "resumed": dict(steps=2, record_memory=True, ckpt_path=str(out / "first" / "ck")),
    }
    for name, knobs in jobs.items():
        res = run_job(out / name, timeout=args.timeout, **common, **knobs)
        if res.returncode != 0:
            print(res.output[-4000:])
            raise SystemExit(f"the {name} job failed (exit {res.returncode})")
    params = json.loads((args.pretrained / "model.safetensors.index.json").read_text())["metadata"]
    bound = max(300e6, 0.25 * 4 * params.get("total_parameters", 0))
    fresh, resumed = peaks(out / "fresh"), peaks(out / "resumed")
    print("| start | private peak per rank | sum |")
    print("|---|---|---|")
    for name, values in (
        ("fresh, from the pretrained directory", fresh),
        ("resumed from the distributed checkpoint", resumed),
    ):
        print(f"| {name} | {' + '.join(f'{v / GB:.3f}' for v in values)} GB | {sum(values) / GB:.3f} GB |")
    extra = sum(resumed) - sum(fresh)
    print(
        f"\nresume - fresh: {extra / GB:+.3f} GB (bound {bound / GB:.2f} GB): {'met' if extra <= bound else 'NOT met'}"
    )
    return 0 if extra <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
