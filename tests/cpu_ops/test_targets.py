"""Every kernel compiled for each x86 vector ISA the update runs on, and checked against its reference there.

Numba compiles for the CPU named by ``NUMBA_CPU_NAME`` (with ``NUMBA_CPU_FEATURES`` empty: that CPU's own features)
instead of this host, so one host checks the code of the others, as far as it can execute it: AVX2 (``haswell``:
the integer fp32 -> bf16 rounding, 8 lanes), AVX-512F without BF16 (``skylake-avx512``: 16 lanes, still the integer
rounding) and AVX-512 with BF16 (``cooperlake``: the conversion instruction). Each target runs the bit-exact tests of
the FP32 update, the bf16 conversions and the gradient sums against torch, and the 8-bit update and codes against
their reference, in a subprocess with its own Numba cache; skipped: a target whose instructions this host lacks, and
the one whose kind of code the rest of the suite runs here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import llvmlite.binding
import pytest

ROOT = Path(__file__).resolve().parents[2]

# the vector features whose instructions the kernels may use, per target (LLVM's names)
AVX2 = ("avx2", "fma", "f16c")
AVX512 = (*AVX2, "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")
TARGETS = {"haswell": AVX2, "skylake-avx512": AVX512, "cooperlake": (*AVX512, "avx512vnni", "avx512bf16")}
NATIVE_BF16 = {"haswell": False, "skylake-avx512": False, "cooperlake": True}

CHECKS = [
    "tests/cpu_ops/test_adamw.py::test_matches_torch",
    "tests/cpu_ops/test_adamw.py::test_sum_equals_presummed",
    "tests/cpu_ops/test_convert.py::test_fp32_to_bf16_special_values_match_torch",
    "tests/cpu_ops/test_convert.py::test_fp32_to_bf16_random_values_match_torch",
    "tests/cpu_ops/test_convert.py::test_fp32_to_bf16_nan_stays_quiet_nan",
    "tests/cpu_ops/test_convert.py::test_bf16_to_fp32_all_patterns_exact",
    "tests/cpu_ops/test_convert.py::test_widen_bf16_writes_torchs_fp32_values_and_bf16_bits_counting_nans",
    "tests/cpu_ops/test_convert.py::test_native_bf16_conversion_equals_the_integer_one_bit_for_bit",
    "tests/cpu_ops/test_accumulate.py",
    "tests/cpu_ops/test_adamw8.py::test_codes_are_the_reference",
    "tests/cpu_ops/test_adamw8.py::test_matches_reference[bf16-0-0.5]",  # the runtime's route: bf16 grad, bf16 copy
    "tests/cpu_ops/test_adamw8.py::test_extreme_values_quantize_to_finite_codes",
    "tests/cpu_ops/test_adamw8.py::test_the_vector_encode_is_the_scalar_encode_bit_for_bit",
]


def host_features() -> set[str]:
    flat = llvmlite.binding.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def suite_target() -> str | None:
    """The target whose kind of code the rest of the suite runs: ``NUMBA_CPU_NAME``'s, else this host's own (the
    widest whose features it has)."""
    named = os.environ.get("NUMBA_CPU_NAME")
    if named:
        return named if named in TARGETS else None
    have = host_features()
    return next((cpu for cpu in ("cooperlake", "skylake-avx512", "haswell") if set(TARGETS[cpu]) <= have), None)


def eligible_targets() -> tuple[list[str], list[str]]:
    """(targets to check here, why each other one is not)."""
    have, run, why = host_features(), [], []
    for cpu in sorted(TARGETS):
        missing = [f for f in TARGETS[cpu] if f not in have]
        if missing:
            why.append(f"this host cannot run {cpu} code (no {', '.join(missing)})")
        elif cpu == suite_target():
            why.append(f"the other tests run {cpu}'s kind of code here already")
        else:
            run.append(cpu)
    return run, why


@pytest.mark.slow  # a cold compile of every kernel signature the checks use: about 35 s a target, two at once
def test_kernels_compiled_for_each_target_match_their_references(tmp_path: Path) -> None:
    targets, why = eligible_targets()
    if not targets:
        pytest.skip("; ".join(why))
    runs = {}
    for cpu in targets:  # each in its own Numba cache; the compiles of two targets run at once (one core each)
        env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path / cpu)}
        probe = "import numba; from cpu_ops import _kernels; print(numba.config.CPU_NAME, _kernels.NATIVE_BF16)"
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                             cwd=ROOT)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [cpu, str(NATIVE_BF16[cpu])]  # the target really is the one named
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs", *CHECKS]
        runs[cpu] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=ROOT)  # fmt: skip
    outputs = {cpu: proc.communicate(timeout=900)[0] for cpu, proc in runs.items()}
    for cpu, proc in runs.items():
        tail = f"{cpu}:\n{outputs[cpu][-4000:]}"
        assert proc.returncode == 0, tail
        if NATIVE_BF16[cpu]:  # the one check that only runs where the conversion instruction is compiled ran
            assert "SKIPPED" not in outputs[cpu], tail
    print(f"checked: {', '.join(targets)}; not: {'; '.join(why) or 'none'}")
