"""Benchmark results: one directory with markdown tables, JSON and TensorBoard scalars, and the machine."""

from __future__ import annotations

import csv
import json
import os
import platform
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Measurement:
    """One implementation at one configuration: the median of interleaved rounds."""

    suite: str
    case: str
    size_m: int
    threads: int
    median_s: float
    bytes_per_param: int
    rounds: int

    @property
    def gparam_s(self) -> float:
        return self.size_m * 1e6 / self.median_s / 1e9

    @property
    def gb_s(self) -> float:
        return self.gparam_s * self.bytes_per_param


@dataclass(frozen=True)
class Ratio:
    """A same-process ratio checked against a target (an acceptance criterion)."""

    suite: str
    label: str
    size_m: int
    threads: int
    value: float
    target: float

    @property
    def applies(self) -> bool:
        return self.target > 0

    @property
    def ok(self) -> bool:
        return self.value >= self.target


@dataclass(frozen=True)
class Table:
    """A result table: markdown in report.md, ``csv/<suite>-<title>.csv``; notes are printed under it."""

    suite: str
    title: str
    headers: list[str]
    rows: list[list[object]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        cell = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        lines = [f"#### {self.title}", "", "| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes])

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", f"{self.suite}-{self.title}").strip("-").lower()


def machine() -> dict[str, object]:
    import torch

    cpu = platform.processor() or platform.machine()
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal:"))) * 1024
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


@dataclass
class BenchReport:
    out: Path
    measurements: list[Measurement] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    tables: list[Table] = field(default_factory=list)
    scalars: list[tuple[str, float, int]] = field(default_factory=list)  # TensorBoard: (tag, value, step)
    runs: dict[str, dict] = field(default_factory=dict)  # run name -> its summary (results.json)

    def add(self, m: Measurement) -> None:
        self.measurements.append(m)

    def interleaved_medians(
        self, benchmark, suite: str, size_m: int, threads: int, cases: dict, rounds: int
    ) -> dict[str, float]:
        """Time every case of ``cases`` (name -> (call, bytes per param)) once per round, in an order that rotates
        by one each round, for ``rounds`` rounds after one warm-up round (pytest-benchmark's ``pedantic``); records
        each case's median and returns the medians (seconds) by name."""
        import time

        import numpy as np

        order = list(cases)
        times: dict[str, list[float]] = defaultdict(list)

        def one_round() -> None:
            for name in order:
                t0 = time.perf_counter()
                cases[name][0]()
                times[name].append(time.perf_counter() - t0)
            order.append(order.pop(0))

        benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=1, iterations=1)
        medians = {}
        for name, (_, nbytes) in cases.items():
            measured = times[name][1:]  # the first call was the warm-up round
            medians[name] = float(np.median(measured))
            self.add(Measurement(suite, name, size_m, threads, medians[name], nbytes, len(measured)))
        return medians

    def ratio(self, r: Ratio) -> None:
        self.ratios.append(r)

    def note(self, suite: str, text: str) -> None:
        if text not in self.notes[suite]:
            self.notes[suite].append(text)

    def table(self, t: Table) -> None:
        self.tables.append(t)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, float(value), int(step)))

    def markdown_sections(self) -> list[str]:
        out = []
        for suite in dict.fromkeys(t.suite for t in self.tables):
            body = "\n\n".join(t.markdown() for t in self.tables if t.suite == suite)
            notes = "".join(f"\n- {n}" for n in self.notes.get(suite, []))
            out.append(f"### {suite}\n\n{body}{notes}")
        for suite in dict.fromkeys(m.suite for m in self.measurements):
            ms = [m for m in self.measurements if m.suite == suite]
            configs = sorted({(m.size_m, m.threads) for m in ms})
            lines = [f"### {suite}", "", "Gparam/s (GB/s at the case's bytes/param), median of interleaved rounds", ""]
            lines.append("| case | B/param | " + " | ".join(f"{s}M x{t}T" for s, t in configs) + " |")
            lines.append("|---|---|" + "---|" * len(configs))
            by = {(m.case, m.size_m, m.threads): m for m in ms}
            for case in dict.fromkeys(m.case for m in ms):
                bpp = next(m.bytes_per_param for m in ms if m.case == case)
                cells = []
                for s, t in configs:
                    m = by.get((case, s, t))
                    cells.append(f"{m.gparam_s:.2f} ({m.gb_s:.0f})" if m else "-")
                lines.append(f"| {case} | {bpp} | " + " | ".join(cells) + " |")
            rs = [r for r in self.ratios if r.suite == suite]
            if rs:
                lines += ["", "| ratio | config | value | target | met |", "|---|---|---|---|---|"]
                for r in rs:
                    target, met = (f">= {r.target:g}", "yes" if r.ok else "NO") if r.applies else ("-", "-")
                    lines.append(f"| {r.label} | {r.size_m}M x{r.threads}T | {r.value:.3f} | {target} | {met} |")
            lines += [""] + [f"- {n}" for n in self.notes.get(suite, [])]
            out.append("\n".join(lines))
        return out

    def write(self) -> list[Path]:
        self.out.mkdir(parents=True, exist_ok=True)
        info = machine()
        md = self.out / "report.md"
        head = f"# Benchmark results\n\nmachine: {json.dumps(info)}\n\n"
        md.write_text(head + "\n\n".join(self.markdown_sections()) + "\n")
        js = self.out / "results.json"
        js.write_text(
            json.dumps(
                {
                    "machine": info,
                    "measurements": [asdict(m) | {"gparam_s": m.gparam_s, "gb_s": m.gb_s} for m in self.measurements],
                    "ratios": [asdict(r) | {"ok": r.ok} for r in self.ratios],
                    "notes": dict(self.notes),
                    "tables": [asdict(t) for t in self.tables],
                    "runs": self.runs,
                },
                indent=1,
                default=str,
            )
        )
        csv_dir = self.out / "csv"
        if self.tables:
            csv_dir.mkdir(exist_ok=True)
        for t in self.tables:
            with open(csv_dir / f"{t.slug}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(t.headers)
                w.writerows(t.rows)
        from torch.utils.tensorboard import SummaryWriter

        tb = self.out / "tensorboard"
        with SummaryWriter(str(tb)) as writer:
            for m in self.measurements:
                writer.add_scalar(f"{m.suite}/{m.case}/gparam_s/{m.threads}T", m.gparam_s, global_step=m.size_m)
            for r in self.ratios:
                writer.add_scalar(f"{r.suite}/ratio/{r.label}/{r.threads}T", r.value, global_step=r.size_m)
            for tag, value, step in self.scalars:
                writer.add_scalar(tag, value, global_step=step)
        return [md, js, tb] + ([csv_dir] if self.tables else [])
