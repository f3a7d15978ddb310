"""The job's precision by host: bf16-mixed where the CPU has fast bf16 matmuls (AVX512-BF16 or AMX) or the device is
a GPU, FP32 on the CPU device of one without, said in one line; bf16 asked for there gets a warning naming its cost."""

from __future__ import annotations

import pytest

from slidedp_lightning.recipes import settings
from slidedp_lightning_cli.finetune import parse

ZEN2 = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse sse2 avx avx2 fma f16c bmi2\n"
ZEN4 = "model name\t: AMD EPYC 9B14\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n"


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """A cpuinfo file of the test's text; oneDNN's ISA left uncapped (a capped one overrides the flags)."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def write(text: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        return str(path)

    return write


def test_fast_bf16_is_read_from_the_cpu_flags(cpuinfo, tmp_path):
    assert settings.fast_bf16(cpuinfo(ZEN2)) is False
    assert settings.fast_bf16(cpuinfo(ZEN4)) is True and settings.fast_bf16(cpuinfo(SAPPHIRE)) is True
    assert settings.fast_bf16(str(tmp_path / "missing")) is None  # unknown: bf16 stays the default
    assert settings.cpu_flags(cpuinfo(ZEN2))[0] == "AMD EPYC 7B12"


@pytest.mark.parametrize(
    ("isa", "fast"), [("avx2", False), ("AVX512_CORE", False), ("AVX512_CORE_BF16", True), ("ALL", True)]
)
def test_onednn_capped_below_avx512_bf16_computes_bf16_slowly(cpuinfo, monkeypatch, isa, fast):
    """``ONEDNN_MAX_CPU_ISA`` (oneDNN runs torch's CPU matmuls) below AVX512-BF16 makes a Zen 4 compute bf16 as an
    AVX2 CPU does (measured: 0.4 GFLOP/s against 190 uncapped)."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert settings.fast_bf16(cpuinfo(ZEN4)) is fast


def test_the_default_precision_is_the_one_the_host_computes_fast(cpuinfo, tmp_path):
    assert settings.default_precision("cpu", cpuinfo(ZEN2)) == "32-true"
    assert settings.default_precision("cuda", cpuinfo(ZEN2)) == "bf16-mixed"  # the GPU computes
    assert settings.default_precision("cpu", cpuinfo(ZEN4)) == "bf16-mixed"
    assert settings.default_precision("cpu", str(tmp_path / "missing")) == "bf16-mixed"


def test_the_job_says_why_or_what_bf16_costs(cpuinfo):
    zen2 = cpuinfo(ZEN2)
    args = parse(["--precision", "32-true"])
    assert settings.bf16_note(args, chosen=True, cpuinfo=zen2) is None  # FP32 asked for: nothing to say
    args.precision = "32-true"
    note = settings.bf16_note(args, chosen=False, cpuinfo=zen2)
    assert note is not None and note.startswith("--precision 32-true by default: this CPU (AMD EPYC 7B12)")
    args.precision = "bf16-mixed"
    note = settings.bf16_note(args, chosen=True, cpuinfo=zen2)
    assert note is not None and "150x slower than FP32" in note and "--precision 32-true is fast here" in note
    assert settings.bf16_note(args, chosen=True, cpuinfo=cpuinfo(ZEN4)) is None


def test_the_command_line_resolves_the_precision_once(monkeypatch):
    monkeypatch.setattr(settings, "fast_bf16", lambda cpuinfo="/proc/cpuinfo": False)
    args = parse([])
    assert (args.precision, args.precision_chosen) == ("32-true", False)
    assert settings.resolved_config(args)["precision"] == "32-true"  # a replayed config repeats it
    assert "precision-chosen" not in settings.resolved_config(args)
    assert parse(["--accelerator", "cuda"]).precision == "bf16-mixed"
    chosen = parse(["--precision", "bf16-mixed"])
    assert (chosen.precision, chosen.precision_chosen) == ("bf16-mixed", True)
    monkeypatch.setattr(settings, "fast_bf16", lambda cpuinfo="/proc/cpuinfo": True)
    assert parse([]).precision == "bf16-mixed"
