"""cpu_ops.adamw8: the square-root int8 / E4M3 block format, block-wise (de)quantization and the fused 8-bit AdamW
against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_ops import (
    MOMENT_FORMAT,
    QUANT_BLOCK,
    adamw8_update,
    adamw_update,
    dequantize_blockwise,
    quantize_blockwise,
)

B = QUANT_BLOCK
F32 = np.float32
TOP = F32(2.0**8)  # the E4M3 value a block's absmax of exp_avg_sq maps to
SQ = F32(127.0**2)  # the square of the int8 code of a block's absmax of exp_avg: codes of sqrt(|value| * SQ / scale)
SCALE_MIN, MOMENT_MAX = F32(2.0**-96), F32(2.0**127)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float().numpy()


def fp8_values(q: np.ndarray) -> np.ndarray:
    """float32 values of E4M3 codes (torch's float8_e4m3fn)."""
    return torch.from_numpy(np.ascontiguousarray(q)).view(torch.float8_e4m3fn).float().numpy()


def fp8_codes(y: np.ndarray) -> np.ndarray:
    """E4M3 codes of float32 values: nearest, ties away from zero (torch's conversion, nearest even, with the ties it
    rounded towards zero moved to the larger magnitude)."""
    y = np.ascontiguousarray(y, F32)
    code = torch.from_numpy(y).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    near = np.abs(fp8_values(code).astype(np.float64))
    away = np.abs(fp8_values((code + 1).astype(np.uint8)).astype(np.float64))  # next magnitude, same sign
    a = np.abs(y.astype(np.float64))
    return np.where((a > near) & (2 * a == near + away), code + 1, code).astype(np.uint8)


def code_values(q: np.ndarray, signed: bool) -> np.ndarray:
    """Values of codes relative to their block's scale: c * |c| / 127**2, c = int8 (exp_avg), E4M3 / 256
    (exp_avg_sq)."""
    if signed:
        c = torch.from_numpy(np.ascontiguousarray(q).view(np.int8)).float()
        return (c * c.abs()).mul(F32(1) / SQ).numpy()
    return fp8_values(q) / TOP


def ref_quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """The format, written out per block with torch: scale = the absmax (values saturated at 2**127; at least 2**-96
    unless 0); exp_avg: int8 code = sign * round(sqrt(|value| * float32(127**2 / scale))) in float32, ties to even;
    exp_avg_sq: E4M3 code of value * (1 / scale) * 2**8, and a positive value never gets code 0."""
    n = x.shape[0]
    q = np.zeros(n, np.uint8)
    scales = np.zeros(-(-n // B), F32)
    for b, s in enumerate(range(0, n, B)):
        v = torch.from_numpy(x[s : s + B].astype(F32))
        top = F32(v.abs().max().item())
        if top > MOMENT_MAX:
            v, top = v.clamp(-MOMENT_MAX, MOMENT_MAX), MOMENT_MAX
        scale = top if top >= SCALE_MIN else (SCALE_MIN if top > 0 else top)
        if signed:
            inv = SQ / scale if scale != 0 else F32(0)
            # the float32 product, its correctly rounded float32 square root (through float64: torch's float32 sqrt
            # on CPU can be half an ulp off), rounded to an integer
            root = torch.round(torch.sqrt((v.abs() * torch.tensor(inv)).double()).float())
            code = torch.copysign(root, v).to(torch.int8).numpy().view(np.uint8)
        else:
            inv = F32(1) / scale if scale != 0 else F32(0)
            y = (v * float(inv) * float(TOP)).abs()  # v >= 0: abs turns -0 into 0 (the codes have no sign bit)
            code = np.maximum(fp8_codes(y.numpy()), (v > 0).numpy())
        q[s : s + B] = code
        scales[b] = scale
    return q, scales


def ref_dequantize(q: np.ndarray, scales: np.ndarray, signed: bool) -> np.ndarray:
    return code_values(q, signed) * np.repeat(scales, B)[: q.shape[0]]


def assert_codes_close(ours: np.ndarray, ref: np.ndarray, exact: np.ndarray | None = None, rate: float = 1e-3) -> None:
    """Within one code step of the reference, rarely off at all, and equal where ``exact`` (E4M3: where the float16 of
    the scaled value is normal; the kernel's rounding through float16 is a double one in float16's subnormals)."""
    diff = np.abs(code_order(ours) - code_order(ref))
    assert diff.max(initial=0) <= 1, f"codes differ by {diff.max()} steps"
    assert np.mean(diff != 0) < rate, f"{np.mean(diff != 0):.3%} codes differ"
    if exact is not None:
        np.testing.assert_array_equal(ours[exact], ref[exact])


def f16_normal(x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Where the E4M3 rounding is exact: the float16 of x / scale is normal (E4M3 normals: >= 2**-14 of scale)."""
    return np.abs(x) >= np.repeat(scales, B)[: x.shape[0]] * F32(2.0**-14)


def code_order(q: np.ndarray) -> np.ndarray:
    """Codes as integers in value order (adjacent values differ by 1): int8 for exp_avg; E4M3 codes of exp_avg_sq
    have no sign bit, so they are in value order as they are."""
    return np.ascontiguousarray(q).view(np.int8).astype(np.int64)


def test_format_constant_and_code_values() -> None:
    assert MOMENT_FORMAT == "sqrt8-e4m3"
    codes = np.arange(256, dtype=np.uint8)
    # exp_avg: int8 codes -127..127 (-128 unused) read back as code * |code| / 127**2 of the block's scale, +-1 and 0
    # exact, the smallest non-zero +-1 / 127**2
    used = codes != 0x80
    values = code_values(codes, True)
    assert values[127] == 1.0 and values[0x81] == -1.0 and values[0] == 0.0
    assert values[1] == F32(1) / SQ and values[0xFF] == -values[1]
    # exp_avg_sq: E4M3 codes without sign bit, up to 256 (the value of the block's absmax): 0 and 120 positive values
    used_v = (codes < 0x80) & (fp8_values(codes) <= TOP)
    assert used_v.sum() == 121
    for signed, keep in ((True, used), (False, used_v)):
        # every code the format writes reads back as its value (a block of scale 1) ...
        block = np.zeros(B, np.uint8)
        block[:256] = codes
        back = dequantize_blockwise(block, np.ones(1, F32), signed)[:256]
        np.testing.assert_array_equal(back[keep], code_values(codes, signed)[keep])
        # ... and is written back as itself
        x = np.zeros(B, F32)
        x[: keep.sum()] = back[keep]
        q, sc = quantize_blockwise(x, signed)
        assert sc[0] == 1.0
        np.testing.assert_array_equal(dequantize_blockwise(q, sc, signed), x)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, B - 1, 3 * B, 10 * B + 17])
def test_round_trip_within_half_a_step(signed: bool, n: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 0, n)).astype(F32)
    if not signed:
        x = np.abs(x)
    x[:: max(1, n // 5)] = 0.0
    q, scales = quantize_blockwise(x, signed)
    assert q.dtype == np.uint8 and q.shape == (n,)
    assert scales.dtype == F32 and scales.shape == (-(-n // B),)
    ref_q, ref_scales = ref_quantize(x, signed)
    np.testing.assert_array_equal(scales, ref_scales)
    if signed:
        np.testing.assert_array_equal(q, ref_q)
    else:
        assert_codes_close(q, ref_q, f16_normal(x, scales), rate=1e-2)
    back = dequantize_blockwise(q, scales, signed)
    np.testing.assert_array_equal(back, ref_dequantize(q, scales, signed))
    # |error| <= half the local code spacing, plus float32 rounding: exp_avg (c - 1/4) / 127**2 of its block's
    # absmax around code c (0.79 % at most), and 0 only below a quarter of its smallest non-zero value (1 / 127**2);
    # exp_avg_sq 1/16 relative (3 mantissa bits) within 14 binades of its block's absmax
    scale = np.repeat(scales, B)[:n].astype(np.float64)
    err = np.abs(back.astype(np.float64) - x)
    if signed:
        assert np.all(err <= scale * 126.75 / 127**2 * (1 + 1e-5) + 1e-7 * np.abs(x)), np.max(err / scale)
        quarters = np.abs(x) * 4 * 127**2  # in units of the block's scale: 1 is half the smallest value
        assert np.all(back[quarters <= scale * (1 - 1e-5)] == 0) and np.all(back[quarters > scale * (1 + 1e-5)] != 0)
    else:
        normal = (x >= scale * 2.0**-14) & (x != 0)
        assert np.all(err[normal] <= x[normal] * (1 / 16 + 1e-6)), np.max(err[normal] / x[normal])
        np.testing.assert_array_equal(back == 0, x == 0)  # the zero guard: exactly the zeros read back as 0
    # zeros and each block's absmax element are exact
    np.testing.assert_array_equal(back[x == 0], 0.0)
    for b in range(scales.shape[0]):
        j = b * B + int(np.argmax(np.abs(x[b * B : (b + 1) * B])))
        assert back[j] == x[j]


def sweep(signed: bool) -> np.ndarray:
    """A dense sweep of float32 bit patterns in [-1, 1] (or [0, 1]), every code value and rounding boundary (E4M3:
    the midpoints; exp_avg: the squares of the midpoints of the square roots), and their neighbours one ulp away;
    absmax 1 in every block, so that a value is its own scaled value."""
    v = np.arange(0, 2**32, 1013, dtype=np.uint64).astype(np.uint32).view(F32)
    values = code_values(np.arange(256, dtype=np.uint8), signed)
    values = np.sort(values[np.isfinite(values) & (np.abs(values) <= 1)]).astype(np.float64)
    if signed:
        roots = np.sign(values) * np.sqrt(np.abs(values))
        mid = (np.sign(roots[1:] + roots[:-1]) * ((roots[1:] + roots[:-1]) / 2) ** 2).astype(F32)
    else:
        mid = ((values[1:] + values[:-1]) / 2).astype(F32)
    v = np.concatenate([v[np.isfinite(v)], values.astype(F32), mid, F32([0.0, -0.0])])
    v = np.concatenate([v, np.nextafter(v, F32(np.inf)), np.nextafter(v, F32(-np.inf))])
    v = v[np.isfinite(v) & (np.abs(v) <= 1) & ((v >= 0) | signed)]
    v[::B] = 1.0
    return v


@pytest.mark.parametrize("signed", [True, False], ids=["exp_avg", "exp_avg_sq"])
def test_codes_are_the_reference(signed: bool) -> None:
    """The kernel's codes against the torch reference on a dense sweep (every code value and midpoint and their
    float32 neighbours included) and on uniform values: equal; for E4M3 except where float16 is subnormal (under
    2**-14 of the block's absmax): there one code off at most, within half a float16 ulp of a midpoint."""
    x = sweep(signed)
    q, scales = quantize_blockwise(x, signed)
    assert np.all(scales == 1.0)
    ref, _ = ref_quantize(x, signed)
    off = np.nonzero(q != ref)[0]
    assert np.all(np.abs(x[off]) < 2.0**-14) and (not signed or off.size == 0), x[off][:5]
    assert_codes_close(q, ref, rate=1e-3)
    mid = (fp8_values(q[off]).astype(np.float64) + fp8_values(ref[off])) / 2 / TOP
    assert np.all(np.abs(x[off] - mid) <= 2.0**-25), x[off][:5]  # float16's subnormal spacing: 2**-24
    rng = np.random.default_rng(3)
    u = rng.uniform(-1 if signed else 0, 1, 2_000_000).astype(F32)
    u[::B] = 1.0
    q, scales = quantize_blockwise(u, signed)
    assert_codes_close(q, ref_quantize(u, signed)[0], f16_normal(u, scales), rate=1e-5)


def torch_reference(p, m, v, g, step, hyper):
    """One torch.optim.AdamW / Adam (single-tensor) step of one segment, in place on float32 numpy views."""
    lr, beta1, beta2, eps, weight_decay, decoupled = hyper
    param = torch.nn.Parameter(torch.from_numpy(p))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, foreach=False)
    opt.state[param] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": torch.from_numpy(m),
        "exp_avg_sq": torch.from_numpy(v),
    }
    param.grad = torch.from_numpy(g)
    opt.step()


def reference_update(state, grads32, segments, hyper, step, grad_scale):
    """Dequantize -> torch AdamW per segment in float32 -> requantize; returns new (param, mq, vq, mam, vam)."""
    p, mq, vq, mam, vam = (a.copy() for a in state)
    m = ref_dequantize(mq, mam, True)
    v = ref_dequantize(vq, vam, False)
    g = grads32[0] * np.float32(grad_scale)
    for r in range(1, grads32.shape[0]):
        g = g + grads32[r] * np.float32(grad_scale)
    for start, stop, group in segments:
        torch_reference(p[start:stop], m[start:stop], v[start:stop], g[start:stop].copy(), step, hyper[group])
    mq, mam = ref_quantize(m, True)
    vq, vam = ref_quantize(v, False)
    return p, mq, vq, mam, vam


HYPER = [
    (1e-2, 0.9, 0.999, 1e-8, 0.1, True),
    (3e-3, 0.3, 0.99, 1e-6, 0.0, True),  # lerp weight >= 0.5: torch's other lerp branch
    (1e-3, 0.9, 0.999, 1e-8, 0.05, False),  # Adam with L2 decay
]
N = 7 * B + 100  # a short tail block
SEGMENTS = np.array([[0, 300, 0], [300, 700, 1], [900, 1500, 2], [1500, N - 3, 0]], np.int64)  # gap 700..900


State = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def new_state(rng: np.random.Generator, n: int = N) -> State:
    return (
        rng.standard_normal(n, dtype=np.float32),
        np.full(n, quantize_blockwise(np.zeros(1, np.float32), True)[0][0], np.uint8),
        np.zeros(n, np.uint8),
        np.zeros(-(-n // B), np.float32),
        np.zeros(-(-n // B), np.float32),
    )


def frozen_mask(n: int, segments: np.ndarray) -> np.ndarray:
    mask = np.ones(n, bool)
    for start, stop, _ in segments:
        mask[start:stop] = False
    return mask


@pytest.mark.parametrize(
    ("grad_kind", "rows", "grad_scale"),
    [("fp32", 0, 1.0), ("bf16", 0, 0.5), ("fp32", 2, 1.0), ("bf16", 3, 1 / 3)],
)
def test_matches_reference(grad_kind: str, rows: int, grad_scale: float) -> None:
    rng = np.random.default_rng(rows + 10 * (grad_kind == "bf16"))
    state = new_state(rng)
    frozen = frozen_mask(N, SEGMENTS)
    out = np.full(N, 7, np.uint16)
    for step in range(1, 6):
        g32 = rng.standard_normal((max(rows, 1), N), dtype=np.float32) * np.float32(0.1 * step)
        g32[:, 40] *= 1000  # an outlier: only its own block's scale grows
        grads = to_bf16_bits(g32) if grad_kind == "bf16" else g32
        values = bf16_bits_to_fp32(grads) if grad_kind == "bf16" else g32
        grad = grads if rows else grads[0]
        ref = reference_update(state, values, SEGMENTS, HYPER, step, grad_scale)
        before_p, before_out = state[0].copy(), out.copy()
        adamw8_update(*state, grad, segments=SEGMENTS, hyper=HYPER, step=step, grad_scale=grad_scale, bf16_out=out)
        p, mq, vq, mam, vam = state
        np.testing.assert_allclose(p, ref[0], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(p[frozen], before_p[frozen])
        np.testing.assert_array_equal(out[frozen], before_out[frozen])
        np.testing.assert_array_equal(out[~frozen], to_bf16_bits(p)[~frozen])
        for name, ours, theirs in (("exp_avg", mq, ref[1]), ("exp_avg_sq", vq, ref[2])):
            diff = np.abs(code_order(ours) - code_order(theirs))
            assert diff.max() <= 1, f"{name}: codes differ by {diff.max()} at step {step}"
            assert np.mean(diff != 0) < 1e-3, f"{name}: {np.mean(diff != 0):.2%} codes differ at step {step}"
        np.testing.assert_allclose(mam, ref[3], rtol=1e-6)
        np.testing.assert_allclose(vam, ref[4], rtol=1e-6)
        # the reference continues from our state, so every step is checked from the same start
    assert mam[0] > 10 * np.median(mam[1:])  # the outlier block


def test_padding_stays_zero_and_all_frozen_only_requantizes() -> None:
    rng = np.random.default_rng(3)
    p, mq, vq, mam, vam = new_state(rng)
    grad = rng.standard_normal(N, dtype=np.float32)
    ref = reference_update((p, mq, vq, mam, vam), grad[None], SEGMENTS, HYPER, 1, 1.0)
    adamw8_update(p, mq, vq, mam, vam, grad, segments=SEGMENTS, hyper=HYPER, step=1)
    m = dequantize_blockwise(mq, mam, True)
    v = dequantize_blockwise(vq, vam, False)
    frozen = frozen_mask(N, SEGMENTS)
    np.testing.assert_array_equal(m[frozen], 0.0)
    np.testing.assert_array_equal(v[frozen], 0.0)
    # updated elements hold their new moments; a positive v is never stored as 0 (the zero guard); m is 0 only where
    # its nearest code is (below a quarter of the smallest non-zero value, 1 / 127**2 of its block's absmax)
    assert np.all(v[~frozen] > 0) and np.mean(m[~frozen] != 0) > 0.95
    np.testing.assert_array_equal(m == 0, dequantize_blockwise(ref[1], ref[3], True) == 0)
    # no segments: the parameters stay, the moments are requantized with their own absmax (a fixed point)
    saved = (p.copy(), mq.copy(), vq.copy(), mam.copy(), vam.copy())
    adamw8_update(p, mq, vq, mam, vam, grad, segments=np.zeros((0, 3), np.int64), hyper=[], step=2)
    for before, after in zip(saved, (p, mq, vq, mam, vam)):
        np.testing.assert_array_equal(before, after)


def test_views_at_block_boundaries_equal_one_call() -> None:
    """Two calls on block-aligned halves equal one call on the whole (what the ledger's shards do)."""
    rng = np.random.default_rng(5)
    whole = new_state(rng)
    p, mq, vq, mam, vam = (a.copy() for a in whole)
    grad = rng.standard_normal(N, dtype=np.float32)
    cut = 4 * B
    adamw8_update(*whole, grad, segments=SEGMENTS, hyper=HYPER, step=1)
    for lo, hi in ((0, cut), (cut, N)):
        seg = SEGMENTS.copy()
        seg[:, :2] = np.clip(seg[:, :2], lo, hi) - lo
        seg = seg[seg[:, 1] > seg[:, 0]]
        view = (p[lo:hi], mq[lo:hi], vq[lo:hi], mam[lo // B : -(-hi // B)], vam[lo // B : -(-hi // B)])
        adamw8_update(*view, grad[lo:hi], segments=seg, hyper=HYPER, step=1)
    for a, b in zip(whole, (p, mq, vq, mam, vam)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_training_close_to_fp32_adamw() -> None:
    """200 steps of least squares: the 8-bit moments reach the FP32 AdamW loss within a few percent."""
    rng = np.random.default_rng(0)
    samples, dim = 4096, B + 300  # two blocks, the second one short
    x = rng.standard_normal((samples, dim)).astype(np.float32)
    w_true = (rng.standard_normal(dim) * rng.uniform(0.01, 1.0, dim)).astype(np.float32)
    y = x @ w_true + np.float32(0.5) * rng.standard_normal(samples).astype(np.float32)

    def loss_grad(w: np.ndarray) -> tuple[float, np.ndarray]:
        r = x @ w - y
        return float(np.mean(r * r)), (np.float32(2 / samples) * (x.T @ r)).astype(np.float32)

    hyper = (3e-2, 0.9, 0.999, 1e-8, 0.0, True)
    w32, m32, v32 = np.zeros(dim, np.float32), np.zeros(dim, np.float32), np.zeros(dim, np.float32)
    state8 = new_state(rng, dim)
    state8[0][:] = 0.0
    seg = np.array([[0, dim, 0]], np.int64)
    for step in range(1, 201):
        _, g = loss_grad(w32)
        adamw_update(w32, m32, v32, g, step=step, lr=hyper[0], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        _, g = loss_grad(state8[0])
        adamw8_update(*state8, g, segments=seg, hyper=[hyper], step=step)
    loss32, loss8 = loss_grad(w32)[0], loss_grad(state8[0])[0]
    start = loss_grad(np.zeros(dim, np.float32))[0]
    assert loss32 < 0.01 * start  # the problem is actually being solved
    assert abs(loss8 - loss32) <= 0.03 * loss32, (loss8, loss32)


def _args(n: int = 2 * B) -> dict:
    nb = -(-n // B)
    return {
        "param": np.zeros(n, np.float32),
        "exp_avg_q": np.zeros(n, np.uint8),
        "exp_avg_sq_q": np.zeros(n, np.uint8),
        "exp_avg_absmax": np.zeros(nb, np.float32),
        "exp_avg_sq_absmax": np.zeros(nb, np.float32),
        "grad": np.zeros(n, np.float32),
        "segments": np.array([[0, n, 0]], np.int64),
        "hyper": [HYPER[0]],
        "step": 1,
    }


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"param": np.zeros(2 * B, np.float64)}, TypeError, "param must have dtype float32"),
        ({"exp_avg_q": np.zeros(2 * B, np.int8)}, TypeError, "exp_avg_q must have dtype uint8"),
        ({"exp_avg_sq_q": np.zeros(2 * B - 1, np.uint8)}, ValueError, "exp_avg_sq_q has length"),
        ({"exp_avg_absmax": np.zeros(3, np.float32)}, ValueError, r"exp_avg_absmax has length 3, expected ceil"),
        ({"exp_avg_sq_absmax": np.zeros(4, np.float32)[::2]}, ValueError, "exp_avg_sq_absmax must be contiguous"),
        ({"grad": np.zeros(2 * B, np.int16)}, TypeError, "grad must have dtype"),
        ({"grad": np.zeros((2, 2 * B - 1), np.float32)}, ValueError, r"grads must have shape"),
        ({"bf16_out": np.zeros(2 * B, np.float32)}, TypeError, "bf16_out must have dtype uint16"),
        ({"segments": np.array([[0, 2 * B, 0]], np.int32)}, TypeError, "segments must have dtype int64"),
        ({"segments": np.array([[0, 2 * B]], np.int64)}, ValueError, r"segments must have shape \(S, 3\)"),
        ({"segments": np.array([[0, 2 * B + 1, 0]], np.int64)}, ValueError, "segment 0 .* out of bounds"),
        ({"segments": np.array([[5, 4, 0]], np.int64)}, ValueError, "segment 0 .* out of bounds"),
        ({"segments": np.array([[0, 10, 0], [5, 20, 0]], np.int64)}, ValueError, "sorted and non-overlapping"),
        ({"segments": np.array([[0, 10, 1]], np.int64)}, ValueError, "names group 1, but hyper has 1 group"),
        ({"hyper": [(1e-3, 0.9, 0.999, 1e-8, 0.0)]}, TypeError, r"hyper\[0\] must be a tuple"),
        ({"hyper": [(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)]}, TypeError, "decoupled must be a bool"),
        ({"hyper": [(-1e-3, 0.9, 0.999, 1e-8, 0.0, True)]}, ValueError, "Invalid learning rate"),
        ({"hyper": [(1e-3, 1.0, 0.999, 1e-8, 0.0, True)]}, ValueError, "Invalid beta1"),
        ({"step": 0}, ValueError, "step must be >= 1"),
        ({"grad_scale": float("nan")}, ValueError, "grad_scale must be finite"),
    ],
)
def test_bad_input(change: dict, exc: type, match: str) -> None:
    kwargs = {**_args(), **change}
    with pytest.raises(exc, match=match):
        adamw8_update(**kwargs)


def test_quantize_bad_input() -> None:
    with pytest.raises(ValueError, match="negative values"):
        quantize_blockwise(np.array([-1.0], np.float32), signed=False)
    with pytest.raises(TypeError, match="x must have dtype float32"):
        quantize_blockwise(np.zeros(4), signed=True)
    with pytest.raises(TypeError, match="signed must be a bool"):
        quantize_blockwise(np.zeros(4, np.float32), signed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="absmax has length 1, expected 2"):
        dequantize_blockwise(np.zeros(B + 1, np.uint8), np.zeros(1, np.float32), signed=True)


def test_rarely_hit_elements_never_step_past_fp32_adam() -> None:
    """Elements whose gradient is mostly 0 beside a large one in the same block (rare embedding rows): their
    second moment decays below the smallest code of the block; stored as 0 it would make the next step
    ``lr * exp_avg / eps``. With the zero guard every 8-bit step stays within FP32 Adam's size."""
    rng = np.random.default_rng(11)
    n, steps, lr = B, 300, 1e-3
    hyper = (lr, 0.9, 0.95, 1e-8, 0.0, True)
    rare = np.arange(1, 65)
    w32, m32, v32 = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    state8 = new_state(rng, n)
    state8[0][:] = 0.0
    seg = np.array([[0, n, 0]], np.int64)
    largest8 = largest32 = 0.0
    for step in range(1, steps + 1):
        g = np.zeros(n, np.float32)
        g[0] = 10.0 * (1 + rng.standard_normal())
        hit = rare[rng.random(rare.size) < 0.03]
        g[hit] = 1e-3 * rng.standard_normal(hit.size).astype(np.float32)
        before32, before8 = w32.copy(), state8[0].copy()
        adamw_update(w32, m32, v32, g, step=step, lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
        adamw8_update(*state8, g, segments=seg, hyper=[hyper], step=step)
        largest32 = max(largest32, float(np.abs(w32 - before32)[rare].max()))
        largest8 = max(largest8, float(np.abs(state8[0] - before8)[rare].max()))
    assert largest32 <= 1.1 * lr  # Adam's steps are about lr at most
    assert largest8 <= 2 * largest32, (largest8, largest32)


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 1e38, 3.3e38, 1e-20, 1e-30, 1e-38, 1e-45])
@pytest.mark.parametrize("grad_kind", ["fp32", "bf16"])
def test_extreme_gradients_never_make_a_weight_non_finite(magnitude: float, grad_kind: str) -> None:
    """Finite gradients far beyond (or below) float32's square range: where FP32 Adam's weights stay finite (its v
    overflows to inf and its update becomes 0, or its v underflows to 0), the 8-bit state's stay finite too, and so
    do its moments, also when the gradients return to normal; as loss * 1e30 would give with mixed precision."""
    rng = np.random.default_rng(int(-np.log10(magnitude) * 10) % 1000)
    n = 3 * B + 17
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    seg = np.array([[0, n, 0]], np.int64)
    state8 = new_state(rng, n)
    w32, m32, v32 = state8[0].copy(), np.zeros(n, F32), np.zeros(n, F32)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)  # fixed per element: grad - exp_avg cannot overflow in FP32 Adam
    for step in range(1, 9):
        scale = magnitude if step <= 5 else 1.0  # five extreme steps, then ordinary gradients
        g = np.minimum(np.abs(rng.standard_normal(n)) * scale, 3.3e38) * sign  # bf16 rounds 3.4e38 to inf
        g[:B] = sign[:B] * scale  # a block of only extreme values (the others mix in small ones)
        g = g.astype(F32)
        grad = to_bf16_bits(g) if grad_kind == "bf16" else g
        g32 = bf16_bits_to_fp32(grad) if grad_kind == "bf16" else g
        assert np.all(np.isfinite(g32))
        adamw_update(w32, m32, v32, g32, step=step, lr=hyper[0], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        adamw8_update(*state8, grad, segments=seg, hyper=[hyper], step=step)
        assert np.all(np.isfinite(w32)), "the FP32 reference itself went non-finite"
        p, mq, vq, mam, vam = state8
        assert np.all(np.isfinite(p)), f"8-bit weights non-finite at step {step}"
        assert np.all(np.isfinite(mam)) and np.all(np.isfinite(vam))
        assert np.all(np.isfinite(dequantize_blockwise(mq, mam, True)))
        assert np.all(np.isfinite(dequantize_blockwise(vq, vam, False)))
    # the steps stay of FP32 Adam's size (at most lr each, 8 steps): no huge finite jumps either
    assert np.max(np.abs(state8[0] - w32)) <= 16 * hyper[0]


def test_extreme_values_quantize_to_finite_codes() -> None:
    x = np.array([3.4e38, -3.4e38, 1e30, 1e-45, 0.0, -1e-40], F32)
    q, scales = quantize_blockwise(x, signed=True)
    back = dequantize_blockwise(q, scales, signed=True)
    assert np.all(np.isfinite(back)) and back[0] == MOMENT_MAX and back[1] == -MOMENT_MAX
    for tiny in (1e-30, 1e-38, 1e-45):  # a block of only tiny values: its scale at least 2**-96, values finite
        q, scales = quantize_blockwise(np.full(3, tiny, F32), signed=True)
        assert scales[0] == max(F32(tiny), SCALE_MIN) and np.all(np.isfinite(dequantize_blockwise(q, scales, True)))
    q, scales = quantize_blockwise(np.abs(x), signed=False)
    back = dequantize_blockwise(q, scales, signed=False)
    assert np.all(np.isfinite(back)) and back[0] == MOMENT_MAX and back[4] == 0.0


def test_the_vector_encode_is_the_scalar_encode_bit_for_bit() -> None:
    """The encode pass's LANES-wide step (explicit LLVM vectors) writes the codes of the scalar functions for any
    float32: random bit patterns (NaN payloads of both signs, infinities, subnormals, -0.0) and ordinary moments,
    with block inverses from 0 to 2**96."""
    from numba import njit

    from cpu_ops._kernels8 import LANES, _encode_lanes, encode_signed, encode_unsigned

    @njit
    def vector(m, r, mq, vq, inv_m, inv_v):
        for t in range(0, m.shape[0], LANES):
            _encode_lanes(m, r, mq, vq, np.uint64(t), np.uint64(t), inv_m, inv_v)

    @njit
    def scalar(m, r, mq, vq, inv_m, inv_v):
        for t in range(m.shape[0]):
            mq[t] = encode_signed(m[t], inv_m)
            vq[t] = encode_unsigned(r[t], inv_v)

    rng = np.random.default_rng(8)
    n = 64 * LANES
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    ordinary = rng.standard_normal(n).astype(F32) * F32(1e-3)
    specials = np.resize(np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1e-45, 2.0**-18, 3e38], F32), n)
    for m in (bits.view(F32), ordinary, specials):
        r = np.abs(m)  # exp_avg_sq is never negative
        top_m, top_v = np.nanmax(np.abs(m[np.isfinite(m)])), np.nanmax(r[np.isfinite(r)])
        for inv_m, inv_v in ((SQ / top_m, F32(1) / top_v), (F32(2.0**90), F32(2.0**96)), (F32(0), F32(0))):
            got = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
            want = np.ones(n, np.uint8), np.ones(n, np.uint8)
            vector(m, r, *got, F32(inv_m), F32(inv_v))
            scalar(m, r, *want, F32(inv_m), F32(inv_v))
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
