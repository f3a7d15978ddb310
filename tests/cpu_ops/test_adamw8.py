"""cpu_ops.adamw8: the dynamic maps, block-wise (de)quantization and the fused 8-bit AdamW against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_ops import (
    QUANT_BLOCK,
    _kernels8,
    adamw8_update,
    adamw_update,
    dequantize_blockwise,
    quantize_blockwise,
    signed_map,
    unsigned_map,
)

B = QUANT_BLOCK


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float().numpy()


def midpoints(code: np.ndarray) -> np.ndarray:
    return ((code[:-1].astype(np.float64) + code[1:].astype(np.float64)) / 2).astype(np.float32)


def ref_quantize(x: np.ndarray, code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest code of x / absmax per block (ties to the lower code), absmax 0 -> the code of 0."""
    n = x.shape[0]
    absmax = np.array([np.max(np.abs(x[s : s + B])) for s in range(0, n, B)], np.float32)
    scale = np.repeat(absmax, B)[:n]
    safe = np.where(scale > 0, scale, np.float32(1))
    y = np.where(scale > 0, x / safe, np.float32(0)).astype(np.float32)
    q = np.searchsorted(midpoints(code), y, side="left").astype(np.uint8)
    if code[0] == 0:  # the unsigned map: a positive value is never stored as 0 (the zero guard)
        q = np.maximum(q, (x > 0).astype(np.uint8))
    return q, absmax


def ref_dequantize(q: np.ndarray, absmax: np.ndarray, code: np.ndarray) -> np.ndarray:
    return code[q] * np.repeat(absmax, B)[: q.shape[0]]


def test_maps() -> None:
    s, u = signed_map(), unsigned_map()
    for code in (s, u):
        assert code.dtype == np.float32 and code.shape == (256,)
        assert np.all(np.diff(code) > 0)
    assert s[0] == -1.0 and s[-1] == 1.0 and 0.0 in s
    assert u[0] == 0.0 and u[-1] == 1.0
    # the dynamic formats span seven decades: smallest non-zero magnitude 1e-7, 1e-6 for the tree's negatives
    assert np.min(np.abs(s[s != 0])) == np.float32(1e-7) and s[s < 0].max() == np.float32(-1e-6)
    assert u[1] == np.float32(1e-7)
    # the top decade of the signed map holds 64 linear values per sign, the unsigned 128
    assert np.sum(s > 0.1) == 64 and np.sum(u > 0.1) == 128
    s[0] = 5.0  # a copy: the module's map is unchanged
    assert signed_map()[0] == -1.0


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, B - 1, 3 * B, 10 * B + 17])
def test_round_trip_within_half_a_step(signed: bool, n: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-8, 0, n)).astype(np.float32)
    if not signed:
        x = np.abs(x)
    x[:: max(1, n // 5)] = 0.0
    q, absmax = quantize_blockwise(x, signed)
    assert q.dtype == np.uint8 and q.shape == (n,)
    assert absmax.dtype == np.float32 and absmax.shape == (-(-n // B),)
    code = signed_map() if signed else unsigned_map()
    ref_q, ref_absmax = ref_quantize(x, code)
    np.testing.assert_array_equal(absmax, ref_absmax)
    np.testing.assert_array_equal(q, ref_q)
    back = dequantize_blockwise(q, absmax, signed)
    np.testing.assert_array_equal(back, ref_dequantize(q, absmax, code))
    # |error| <= half the local code spacing (times the block's absmax), plus float32 rounding
    scale = np.repeat(absmax, B)[:n].astype(np.float64)
    y = x / np.where(scale > 0, scale, 1.0)
    hi = np.searchsorted(code, y).clip(1, 255)
    spacing = (code[hi].astype(np.float64) - code[hi - 1]) * scale
    err = np.abs(back.astype(np.float64) - x)
    guarded = (code[0] == 0) & (x > 0) & (y < code[1] / 2)  # below half the smallest code: rounded up to it
    assert np.all(err[~guarded] <= spacing[~guarded] / 2 * (1 + 1e-6) + 1e-7 * np.abs(x[~guarded]))
    np.testing.assert_array_equal(q[guarded], 1)
    if not signed:  # the zero guard: exactly the zeros read back as 0
        np.testing.assert_array_equal(back == 0, x == 0)
    # zeros and each block's absmax element are exact
    np.testing.assert_array_equal(back[x == 0], 0.0)
    for b in range(absmax.shape[0]):
        j = b * B + int(np.argmax(np.abs(x[b * B : (b + 1) * B])))
        assert back[j] == x[j]


def test_quantize_every_float32_in_range() -> None:
    """The table lookup equals a binary search for a dense sweep of float32 bit patterns in [-1, 1]."""
    bits = np.arange(0, 2**32, 1013, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    v = v[np.isfinite(v) & (np.abs(v) <= 1)]
    for signed in (True, False):
        x = v if signed else v[v >= 0]
        x = x.copy()
        x[::B] = 1.0  # absmax 1 in every block: x / absmax == x
        q, absmax = quantize_blockwise(x, signed)
        assert np.all(absmax == 1.0)
        code = signed_map() if signed else unsigned_map()
        want = np.searchsorted(midpoints(code), x, side="left")
        if not signed:
            want = np.maximum(want, x > 0)  # the zero guard
        np.testing.assert_array_equal(q, want)


def grid_quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise codes of the fused update's table-free quantizer."""
    q = np.empty(x.shape[0], np.uint8)
    absmax = np.empty(-(-x.shape[0] // B), np.float32)
    _kernels8.quantize_kernel(x, q, absmax, B, 1, signed, True)
    return q, absmax


def sweep(signed: bool) -> np.ndarray:
    """A dense sweep of float32 bit patterns in [-1, 1] (or [0, 1]), every code and midpoint, and their
    neighbours one ulp away; absmax 1 in every block, so x / absmax == x."""
    v = np.arange(0, 2**32, 1013, dtype=np.uint64).astype(np.uint32).view(np.float32)
    code = signed_map() if signed else unsigned_map()
    v = np.concatenate([v, code, midpoints(code), np.float32([0.0, -0.0])])
    v = np.concatenate([v, np.nextafter(v, np.float32(2)), np.nextafter(v, np.float32(-2))])
    v = v[np.isfinite(v) & (np.abs(v) <= 1) & ((v >= 0) | signed)]
    v[::B] = 1.0
    return v


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_table_free_codes_are_the_nearest_but_within_float32_ulps_of_a_midpoint(signed: bool) -> None:
    """The fused update's quantizer against the exact one: one code off at most, only where y is within 4 ulps
    of the midpoint between the two codes, and rarely: under 1e-5 of uniform random values."""
    code = signed_map() if signed else unsigned_map()
    mid = midpoints(code)
    x = sweep(signed)
    exact, _ = quantize_blockwise(x, signed)
    grid, absmax = grid_quantize(x, signed)
    assert np.all(absmax == 1.0)
    diff = grid.astype(np.int64) - exact.astype(np.int64)
    assert np.abs(diff).max() <= 1
    off = np.nonzero(diff)[0]
    between = mid[np.minimum(grid[off], exact[off])]
    assert np.all(np.abs(x[off] - between) <= 4 * np.spacing(np.abs(between))), x[off][:5]
    # the codes themselves, zeros (both signs) and +-1 are exact
    for value in (*code, 0.0, -0.0):
        y = np.full(B, value, np.float32)
        y[0] = 1.0
        assert grid_quantize(y, signed)[0][1] == quantize_blockwise(y, signed)[0][1], value
    rng = np.random.default_rng(3)
    u = rng.uniform(-1 if signed else 0, 1, 2_000_000).astype(np.float32)
    u[::B] = 1.0
    rate = np.mean(grid_quantize(u, signed)[0] != quantize_blockwise(u, signed)[0])
    assert rate < 1e-5, rate


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
    m = ref_dequantize(mq, mam, signed_map())
    v = ref_dequantize(vq, vam, unsigned_map())
    g = grads32[0] * np.float32(grad_scale)
    for r in range(1, grads32.shape[0]):
        g = g + grads32[r] * np.float32(grad_scale)
    for start, stop, group in segments:
        torch_reference(p[start:stop], m[start:stop], v[start:stop], g[start:stop].copy(), step, hyper[group])
    mq, mam = ref_quantize(m, signed_map())
    vq, vam = ref_quantize(v, unsigned_map())
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
            diff = np.abs(ours.astype(np.int64) - theirs)
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
    adamw8_update(p, mq, vq, mam, vam, grad, segments=SEGMENTS, hyper=HYPER, step=1)
    m = dequantize_blockwise(mq, mam, True)
    v = dequantize_blockwise(vq, vam, False)
    frozen = frozen_mask(N, SEGMENTS)
    np.testing.assert_array_equal(m[frozen], 0.0)
    np.testing.assert_array_equal(v[frozen], 0.0)
    # updated elements hold their new moments; a positive v is never stored as 0 (the zero guard)
    assert np.all(v[~frozen] > 0) and np.all(m[~frozen] != 0)
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
