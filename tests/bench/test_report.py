"""Targets are verdicts in report.md, never a stop (a failure only when strict); tables are rewritten in place."""

from __future__ import annotations

import json
import os

from bench.report import BenchReport, Ratio, Table, Verdict


def test_a_missed_ratio_is_a_verdict_in_the_report_not_an_error(tmp_path):
    report = BenchReport(tmp_path)
    missed = Ratio("adamw8_kernel", "8-bit / fp32 moments", 64, 2, 0.18, 1.0)
    met = Ratio("adamw8_kernel", "8-bit / its ceiling", 64, 2, 0.95, 0.0)  # reported only: no target
    report.ratio(missed)
    report.ratio(met)
    assert report.check([missed.verdict()], record=False) == []  # not strict: nothing fails
    md = (tmp_path / "report.md").read_text()
    assert "0 of 1 targets met; missed: adamw8_kernel: 8-bit / fp32 moments (64M x2T)" in md
    assert "| adamw8_kernel | 8-bit / fp32 moments | 64M x2T | 0.180 | >= 1 | NO |" in md
    saved = json.loads((tmp_path / "results.json").read_text())["verdicts"]
    assert [(v["label"], v["ok"]) for v in saved] == [("8-bit / fp32 moments", False)]


def test_strict_returns_the_missed_targets(tmp_path):
    report = BenchReport(tmp_path, strict=True)
    good = Verdict("systems", "SlideDP host slope", "3 sizes", "14.2 GB/B", "<= 14.5 GB/B", True)
    bad = Verdict("systems", "loss max abs diff vs FSDP2", "32-true", "0.5", "<= 0.0001", False)
    missed = report.check([good, bad])
    assert missed == [bad.line()]
    assert "1 of 2 targets met" in (tmp_path / "report.md").read_text()  # written before the failure


def test_a_rebuilt_table_replaces_the_old_one(tmp_path):
    report = BenchReport(tmp_path)
    report.table(Table("systems", "Throughput", ["system", "tokens/s"], [["slidedp", "pending"]]))
    report.table(Table("systems", "Memory", ["system"], [["slidedp"]]))
    report.table(Table("systems", "Throughput", ["system", "tokens/s"], [["slidedp", 123.0]]))
    assert [t.title for t in report.tables] == ["Throughput", "Memory"]
    report.write()
    md = (tmp_path / "report.md").read_text()
    assert "| slidedp | 123 |" in md and "pending" not in md
    assert (tmp_path / "csv" / "systems-throughput.csv").read_text().splitlines() == [
        "system,tokens/s",
        "slidedp,123.0",
    ]


def test_a_verdict_checked_again_replaces_the_first(tmp_path):
    report = BenchReport(tmp_path)
    report.check([Verdict("systems", "x", "c", "1", ">= 2", False)])
    report.check([Verdict("systems", "x", "c", "3", ">= 2", True)])
    assert [v.ok for v in report.verdicts] == [True]


def test_notes_only_suites_are_in_the_report(tmp_path):
    report = BenchReport(tmp_path)
    report.note("one-time costs", "ZeRO-Offload: not installed: DeepSpeed is not installed")
    report.write()
    assert "### one-time costs\n\nZeRO-Offload: not installed" in (tmp_path / "report.md").read_text()


def test_every_report_names_the_cpu_its_vector_isa_numba_target_and_cpu_precision(tmp_path):
    from bench.report import VECTOR_ISAS, machine
    from slidedp_lightning.recipes.settings import cpu_flags, default_precision

    info = machine()
    flags = cpu_flags()[1]
    widest = next((name for flag, name in VECTOR_ISAS if flag in flags), None)
    assert info["vector_isa"] == (widest or ("not recorded" if not flags else "SSE"))
    assert info["cpu_precision"] == default_precision("cpu") and info["numba_target"]
    import torch

    assert info["torch_cpu"] == torch.backends.cpu.get_cpu_capability()
    assert info["onednn_max_isa"] == os.environ.get("ONEDNN_MAX_CPU_ISA", "all")
    report = BenchReport(tmp_path)
    report.write()
    head = (tmp_path / "report.md").read_text().splitlines()[2]
    assert head.startswith("machine: ") and f'"vector_isa": "{info["vector_isa"]}"' in head, head
