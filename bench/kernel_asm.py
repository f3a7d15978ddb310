"""The vector loops of the fused update kernels as compiled on this host: instructions per element.

A kernel that moves fewer bytes is faster only while its math fits in the time those bytes take. This reads
the machine code Numba/LLVM produced for the 8-bit-moment kernel and for the FP32 one (the benchmark's route:
bf16 gradient in, bf16 copy out) and lists each innermost loop that holds packed vector instructions: its
static instructions (both sides of a branch inside the loop count), the elements one iteration handles and
their quotient. The 8-bit kernel's loops on that route are the update loop (one per lerp branch; a group uses
one) and the encode loop; the others decode frozen gaps or saturate out-of-range blocks. Compiles into a temporary cache directory, since Numba does not disassemble cached code
(a cold compile of one signature each: seconds). ``--cpu NAME`` compiles for the LLVM CPU ``NAME`` with its own
features instead of this host's (Numba's ``NUMBA_CPU_NAME``, with ``NUMBA_CPU_FEATURES`` empty), so the loops of an
AVX2 target (``haswell``, ``znver2``) can be read on an AVX-512 machine::

    python -m bench.kernel_asm [--cpu znver2]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass

FUNCTION = re.compile(r"^([^\s.][^:]*):\s*$")
LABEL = re.compile(r"^(\.LBB\d+_\d+):")
JUMP = re.compile(r"^\s+j(?!mp\b)\w+\s+(\.LBB\d+_\d+)\s*$")  # conditional: a loop's latch, not a layout jump
STEP = re.compile(r"^\s+addq\s+\$(\d+), %(\w+)\s*$")
PACKED = re.compile(r"\bv\w+p[sd]\b.*%[yz]mm|\bvp\w+\b.*%[yz]mm")
# the costly instructions of interest: (F16C or AVX512-FP16 "x") float16 conversions, gathers/inserts of table lookups
MARKERS = ("vsqrtps", "vdivps", "vcvtps2ph", "vcvtph2ps", "vinsertps", "vpgatherdd")


@dataclass(frozen=True)
class Loop:
    label: str
    instructions: int
    elements: int  # the index step of one iteration (0: not found)
    markers: dict[str, int]

    @property
    def per_element(self) -> float:
        return self.instructions / self.elements if self.elements else float("nan")


def is_instruction(line: str) -> bool:
    return line.startswith("\t") and not line.lstrip().startswith(".")


def parallel_bodies(asm: str) -> str:
    """The functions of ``asm`` that hold a ``prange`` body (Numba's parfor gufuncs, not their wrappers)."""
    keep, out = False, []
    for line in asm.splitlines():
        if m := FUNCTION.match(line):
            keep = "numba_parfor_gufunc" in m.group(1) and not m.group(1).startswith("__gufunc__")
        if keep:
            out.append(line)
    return "\n".join(out)


def vector_loops(asm: str) -> list[Loop]:
    """Innermost backward-branch ranges of ``asm`` holding packed ymm instructions."""
    lines = asm.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    spans = []
    for i, line in enumerate(lines):
        m = JUMP.match(line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    # one span per label (its last backward jump), and only innermost ones: no other span inside
    last = {s: e for s, e in spans}
    spans = sorted(last.items())
    inner = [(s, e) for s, e in spans if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in spans)]
    loops = []
    for s, e in inner:
        body = [line for line in lines[s : e + 1] if is_instruction(line)]
        if not any(PACKED.search(line) for line in body):
            continue
        steps = [int(m.group(1)) for line in body if (m := STEP.match(line)) and _indexes(body, m.group(2))]
        markers = {k: sum(1 for line in body if re.search(rf"\b{k}x?\b", line)) for k in MARKERS}
        loops.append(Loop(LABEL.match(lines[s]).group(1), len(body), max(steps, default=0), markers))  # type: ignore[union-attr]
    return loops


def _indexes(body: list[str], reg: str) -> bool:
    """``reg`` is the index of a memory operand in ``body`` (so its step counts elements, not bytes)."""
    return any(re.search(rf"\(%\w+,%{reg}(,\d)?\)", line) for line in body)


def kernel_asm() -> dict[str, str]:
    """Run each kernel once on small buffers and return its machine code (first signature): the benchmark's 8-bit and
    FP32 cases (bf16 gradient in, bf16 copy out) and the FP32 update without the copy."""
    from bench.test_adamw8_kernel import BETA1, BETA2, EPS, LR, WEIGHT_DECAY, Buffers, build_cases
    from cpu_ops import _kernels, _kernels8, adamw_update

    buffers = Buffers(1 << 16)
    cases = build_cases(buffers)
    cases["8-bit moments"][0]()
    cases["fp32 moments"][0]()
    b = buffers
    adamw_update(b.p, b.m, b.v, b.g16, step=1, lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WEIGHT_DECAY)
    kernels = {
        "8-bit moments": _kernels8.adamw8_kernel,
        "fp32 moments": _kernels.adamw_bf16_out_kernel,
        NO_COPY: _kernels.adamw_kernel,
    }
    return {name: k.inspect_asm(k.signatures[0]) for name, k in kernels.items()}


NO_COPY = "fp32 moments, no copy"


def summary(loops: dict[str, list[Loop]]) -> list[str]:
    """The two ratios of instructions per element that stand in for speed where a target cannot be timed: the 8-bit
    update (its update loop, the one with the square root and the division, plus its encode loop, the one with the
    float16 conversion) against the FP32 update with the bf16 copy, and that against the FP32 update without the
    copy. A kernel has one such loop per flag combination (weight decay, lerp branch): their mean counts, over the
    main vector bodies only (the widest of those loops: LLVM may add narrower epilogue loops for the last elements of
    a range, which run a few iterations per block at most)."""

    def mean(name: str, *markers: str) -> float:
        found = [x for x in loops.get(name, []) if all(x.markers[k] for k in markers)]
        widest = max((x.elements for x in found), default=0)
        values = [x.per_element for x in found if x.elements == widest]
        return sum(values) / len(values) if values else float("nan")

    eight = mean("8-bit moments", "vsqrtps", "vdivps") + mean("8-bit moments", "vcvtps2ph")
    copy, plain = mean("fp32 moments", "vsqrtps"), mean(NO_COPY, "vsqrtps")
    return [
        f"8-bit update + encode: {eight:.1f} instructions/element, {eight / copy:.2f}x the FP32 update with the bf16 "
        f"copy ({copy:.1f})",
        f"FP32 update with the bf16 copy: {copy / plain:.2f}x the one without ({plain:.1f})",
    ]


AVX512 = re.compile(r"%zmm|%k[1-7]\b|\{%k")  # a 512-bit register or a mask register: AVX-512 code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cpu", metavar="NAME", help="compile for this LLVM CPU (haswell, znver2, skylake-avx512, ...)"
    )
    args = parser.parse_args(argv)
    if "numba" in sys.modules:
        raise RuntimeError("bench.kernel_asm must set NUMBA_CACHE_DIR (and the target) before numba is imported")
    with tempfile.TemporaryDirectory(prefix="slidedp-asm-") as cache:
        os.environ["NUMBA_CACHE_DIR"] = cache
        if args.cpu:  # the named CPU's own features (an empty list: LLVM takes them from the name)
            os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = args.cpu, ""
        import numba

        print(f"target: {numba.config.CPU_NAME or 'this host'} (this host as LLVM sees it: {_llvm_cpu()})")
        print(
            "| kernel | loop | instructions | elements/iteration | instructions/element | " + " | ".join(MARKERS) + " |"
        )
        print("|---|---|---|---|---|" + "---|" * len(MARKERS))
        found = {}
        for name, asm in kernel_asm().items():
            if AVX512.search(parallel_bodies(asm)):
                print(f"{name}: uses AVX-512 registers")
            found[name] = vector_loops(parallel_bodies(asm))
            for loop in found[name]:
                marks = " | ".join(str(loop.markers[k]) for k in MARKERS)
                print(
                    f"| {name} | {loop.label} | {loop.instructions} | {loop.elements} | "
                    f"{loop.per_element:.1f} | {marks} |"
                )
        print()
        print("\n".join(summary(found)))
    return 0


def _llvm_cpu() -> str:
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name()


if __name__ == "__main__":
    raise SystemExit(main())
