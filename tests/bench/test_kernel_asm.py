"""bench.kernel_asm's loop finder on hand-written assembly: innermost vector loops of prange bodies only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_asm import AVX512, MARKERS, NO_COPY, Loop, parallel_bodies, summary, vector_loops

ROOT = Path(__file__).resolve().parents[2]

ASM = """\
__gufunc__._ZN13_3cdynamic_3e36__numba_parfor_gufunc_0xabc:
.LBB0_1:
\tvaddps\t%ymm0, %ymm1, %ymm1
\taddq\t$8, %rax
\tjne\t.LBB0_1
_ZN13_3cdynamic_3e36__numba_parfor_gufunc_0xabc:
.LBB4_1:
\tmovq\t8(%rsp), %rcx
.LBB4_2:
\tvmovups\t(%rdx,%rsi,4), %ymm2
\tvsqrtps\t%ymm2, %ymm2
\t.p2align\t4
\tvmovups\t%ymm2, (%rdx,%rsi,4)
\taddq\t$8, %rsi
\tcmpq\t%rsi, %r8
\tjne\t.LBB4_2
.LBB4_3:
\tmovss\t(%rdx,%rsi,4), %xmm2
\tincq\t%rsi
\tjne\t.LBB4_3
\tdecq\t%rcx
\tjne\t.LBB4_1
NRT_incref:
.LBB9_1:
\tvaddps\t%ymm0, %ymm1, %ymm1
\tjne\t.LBB9_1
"""


def test_only_the_innermost_packed_loops_of_prange_bodies_count() -> None:
    loops = vector_loops(parallel_bodies(ASM))
    assert [loop.label for loop in loops] == [".LBB4_2"]  # not the outer loop, the scalar one, nor other functions
    (loop,) = loops
    assert loop.instructions == 6  # the directive does not count
    assert loop.elements == 8 and loop.per_element == 6 / 8
    assert loop.markers["vsqrtps"] == 1 and loop.markers["vdivps"] == 0


def test_avx512_code_is_recognized() -> None:
    assert AVX512.search("\tvaddps\t%zmm0, %zmm1, %zmm1") and AVX512.search("\tvmovups\t(%rax), %ymm1 {%k1}")
    assert not AVX512.search("\tvaddps\t%ymm0, %ymm1, %ymm1")


def test_a_loop_without_an_element_index_has_no_elements() -> None:
    asm = "_ZN_numba_parfor_gufunc_1:\n.LBB1_1:\n\tvaddps\t%ymm0, %ymm1, %ymm1\n\taddq\t$32, %rax\n\tjne\t.LBB1_1\n"
    (loop,) = vector_loops(parallel_bodies(asm))
    assert loop.elements == 0  # %rax is a pointer bump, not an index: bytes, not elements


def test_an_unconditional_backward_jump_is_not_a_loop() -> None:
    """LLVM places blocks after the loop that ``jmp`` back into it; only a conditional latch closes a loop."""
    asm = (
        "_ZN_numba_parfor_gufunc_2:\n.LBB2_1:\n\tvmovups\t64(%rsp), %ymm26\n\tjmp\t.LBB2_3\n"
        ".LBB2_2:\n\tmovq\t(%rsp), %r11\n\tjmp\t.LBB2_1\n.LBB2_3:\n\tret\n"
    )
    assert vector_loops(parallel_bodies(asm)) == []


@pytest.mark.slow  # two cold Numba compiles in a subprocess
def test_an_avx2_target_is_compiled_on_any_x86_host() -> None:
    """``--cpu haswell`` compiles the kernels for that CPU wherever this runs: no AVX-512 register in them, and the
    FP32 update's vector loops listed with their instructions per element."""
    pytest.importorskip(
        "threadpoolctl", reason="bench.kernel_asm runs the benchmark's cases: pip install -e '.[bench]'"
    )
    proc = subprocess.run([sys.executable, "-m", "bench.kernel_asm", "--cpu", "haswell"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("target: haswell (this host") and "AVX-512 registers" not in proc.stdout, proc.stdout
    fp32 = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| fp32 moments |")]
    assert fp32 and all(float(cells[5]) > 0 for cells in fp32), proc.stdout
    eight, copy = proc.stdout.strip().splitlines()[-2:]
    ratios = [float(x) for x in re.findall(r"([0-9.]+)x the", eight + copy)]
    assert len(ratios) == 2 and all(1.0 < r < 4.0 for r in ratios), proc.stdout  # both measured, each costs more


def test_the_summary_compares_the_mean_main_loops_of_each_kernel() -> None:
    def loop(per: int, *marks: str, elements: int = 8) -> Loop:
        return Loop(".L", per * elements, elements, {k: int(k in marks) for k in MARKERS})

    found = {
        "8-bit moments": [loop(6, "vsqrtps", "vdivps", "vcvtph2ps"), loop(8, "vsqrtps", "vdivps"), loop(2),
                          loop(4, "vsqrtps", "vcvtps2ph"),
                          loop(12, "vsqrtps", "vdivps", elements=4)],  # an epilogue: not counted
        "fp32 moments": [loop(4, "vsqrtps", "vdivps"), loop(6, "vsqrtps", "vdivps")],
        NO_COPY: [loop(2, "vsqrtps", "vdivps"), loop(3, "vsqrtps", "vdivps")],
    }  # fmt: skip
    eight, copy = summary(found)
    assert eight.startswith("8-bit update + encode: 11.0 instructions/element, 2.20x") and "(5.0)" in eight
    assert copy == "FP32 update with the bf16 copy: 2.00x the one without (2.5)"
