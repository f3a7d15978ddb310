"""Benchmark results: one directory with markdown tables, JSON, CSV, plots and TensorBoard scalars, and the machine.

Targets (speed ratios, memory slopes, loss bounds) are :class:`Verdict` s: written at the top of ``report.md``,
never a reason to stop a run. :meth:`BenchReport.write` may be called at any time (after every job, on
interrupt): it rewrites the tables from what has been recorded so far.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


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

    def verdict(self) -> Verdict:
        return Verdict(self.suite, self.label, f"{self.size_m}M x{self.threads}T", f"{self.value:.3f}",
                       f">= {self.target:g}", self.ok)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    """One target checked against a measurement: reported, and enforced only with ``--bench-strict``."""

    suite: str
    label: str
    config: str
    value: str
    target: str
    ok: bool

    def line(self) -> str:
        return f"{self.suite}: {self.label} ({self.config}) = {self.value}, target {self.target}"


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


# the widest vector ISA a CPU's flags name, widest first
VECTOR_ISAS = (
    ("amx_bf16", "AMX + AVX-512-BF16"),
    ("avx512_bf16", "AVX-512 + AVX-512-BF16"),
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
)


def _numba_target() -> str:
    """The CPU name Numba compiles the kernels for (``NUMBA_CPU_NAME``, else the host's, as LLVM names it)."""
    name = os.environ.get("NUMBA_CPU_NAME")
    if name:
        return name
    try:
        import llvmlite.binding as llvm

        return str(llvm.get_host_cpu_name())
    except (ImportError, RuntimeError):
        return "not recorded"


@cache
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
    from slidedp_lightning.recipes.settings import cpu_flags, default_precision

    flags = cpu_flags()[1]
    isa = next((name for flag, name in VECTOR_ISAS if flag in flags), "not recorded" if not flags else "SSE")
    return {
        "cpu": cpu,
        "vector_isa": isa,
        "numba_target": _numba_target(),
        # torch's CPU kernels and oneDNN's matmuls: the hardware's, unless held lower (ATEN_CPU_CAPABILITY,
        # ONEDNN_MAX_CPU_ISA: a run standing in for an older CPU says so here)
        "torch_cpu": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "all"),
        "cpu_precision": default_precision("cpu"),  # what this host computes fast on the CPU device
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
    checks: list[Verdict] = field(default_factory=list)  # targets other than the kernel suites' ratios
    timings: dict[str, float] = field(default_factory=dict)  # what took how long (one-time costs, jobs), seconds
    plots: list[Path] = field(default_factory=list)  # written by the last write with plots
    strict: bool = False  # --bench-strict: a missed target fails its test
    plot_error: str = ""  # why the last plots were not written ("" when they were)

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
        """Add ``t``, or replace the table of the same suite and title (a table rebuilt as its runs finish)."""
        for i, old in enumerate(self.tables):
            if old.slug == t.slug:
                self.tables[i] = t
                return
        self.tables.append(t)

    def verdict(self, v: Verdict) -> None:
        self.checks = [c for c in self.checks if (c.suite, c.label, c.config) != (v.suite, v.label, v.config)]
        self.checks.append(v)

    def check(self, verdicts: list[Verdict], record: bool = True) -> list[str]:
        """Record ``verdicts`` (``record=False``: they are recorded already) and write the report; returns the
        missed ones that must fail the run: none unless ``strict``."""
        for v in verdicts if record else []:
            self.verdict(v)
        self.write()
        return [v.line() for v in verdicts if not v.ok] if self.strict else []

    @property
    def verdicts(self) -> list[Verdict]:
        """Every target checked so far: the kernel suites' ratios that have one, then the other checks."""
        return [r.verdict() for r in self.ratios if r.applies] + self.checks

    def verdict_section(self) -> str:
        vs = self.verdicts
        if not vs:
            return "## Verdicts\n\nno target checked yet\n"
        missed = [v for v in vs if not v.ok]
        lines = [
            "## Verdicts",
            "",
            f"{len(vs) - len(missed)} of {len(vs)} targets met"
            + (f"; missed: {', '.join(f'{v.suite}: {v.label} ({v.config})' for v in missed)}" if missed else "")
            + " (a missed target fails the run only with --bench-strict)",
            "",
            "| suite | target | config | value | required | met |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {v.suite} | {v.label} | {v.config} | {v.value} | {v.target} | {'yes' if v.ok else 'NO'} |" for v in vs
        ]
        return "\n".join(lines) + "\n"

    def timing_section(self) -> str:
        if not self.timings:
            return ""
        lines = ["## Times", "", "| what | seconds |", "|---|---|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in self.timings.items()]
        return "\n".join(lines) + "\n"

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
        shown = {t.suite for t in self.tables} | {m.suite for m in self.measurements}
        for name, texts in self.notes.items():  # suites with notes only (one-time costs, capacity's table)
            if name not in shown and texts:
                out.append(f"### {name}\n\n" + "\n\n".join(texts))
        return out

    def write(self, final: bool = False, plots: bool = False) -> list[Path]:
        """Write report.md, results.json and the CSVs from what is recorded; ``plots`` (or ``final``) also the
        plots (PNG, drawn from results.json by ``bench/plots.py``); ``final`` also the TensorBoard scalars (once:
        a second write would repeat every scalar)."""
        self.out.mkdir(parents=True, exist_ok=True)
        info = machine()
        md = self.out / "report.md"
        js = self.out / "results.json"
        self._write_json(js, info)
        if final or plots:
            from bench.plots import write_plots

            try:
                self.plots, self.plot_error = write_plots(self.out), ""
            except Exception as exc:  # a plot must never cost the tables
                log.exception("plots not written")
                self.plot_error = f"plots not written: {type(exc).__name__}: {exc}"
        head = f"# Benchmark results\n\nmachine: {json.dumps(info)}\n\n{self.verdict_section()}\n"
        if self.plots or self.plot_error:
            images = [f"![{p.stem}]({p.relative_to(self.out)})" for p in self.plots]
            head += "## Plots\n\n" + "\n".join(images + [self.plot_error]).strip() + "\n\n"
        body = "\n\n".join(self.markdown_sections())
        tmp = md.with_suffix(".md.tmp")
        tmp.write_text(head + body + "\n\n" + self.timing_section())
        tmp.replace(md)
        self._write_csv()
        paths = [md, js] + ([self.out / "csv"] if self.tables else []) + self.plots
        if final:
            paths.append(self._write_tensorboard())
        return paths

    def _write_json(self, js: Path, info: dict) -> None:
        tmp = js.with_suffix(".json.tmp")
        tmp.write_text(
            json.dumps(
                {
                    "machine": info,
                    "measurements": [asdict(m) | {"gparam_s": m.gparam_s, "gb_s": m.gb_s} for m in self.measurements],
                    "ratios": [asdict(r) | {"ok": r.ok} for r in self.ratios],
                    "verdicts": [asdict(v) for v in self.verdicts],
                    "timings": self.timings,
                    "notes": dict(self.notes),
                    "tables": [asdict(t) for t in self.tables],
                    "runs": self.runs,
                },
                indent=1,
                default=str,
            )
        )
        tmp.replace(js)

    def _write_csv(self) -> None:
        csv_dir = self.out / "csv"
        if self.tables:
            csv_dir.mkdir(exist_ok=True)
        for t in self.tables:
            with open(csv_dir / f"{t.slug}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(t.headers)
                w.writerows(t.rows)

    def _write_tensorboard(self) -> Path:
        from torch.utils.tensorboard import SummaryWriter

        tb = self.out / "tensorboard"
        with SummaryWriter(str(tb)) as writer:
            for m in self.measurements:
                writer.add_scalar(f"{m.suite}/{m.case}/gparam_s/{m.threads}T", m.gparam_s, global_step=m.size_m)
            for r in self.ratios:
                writer.add_scalar(f"{r.suite}/ratio/{r.label}/{r.threads}T", r.value, global_step=r.size_m)
            for tag, value, step in self.scalars:
                writer.add_scalar(tag, value, global_step=step)
        return tb
