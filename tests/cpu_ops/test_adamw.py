"""cpu_ops.adamw against torch.optim.AdamW / Adam (single-tensor CPU path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_ops import adamw_update, adamw_update_sum, is_vectorized

N = 100_003  # not a multiple of the vector width: exercises the loop tails
STEPS = 10
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
TOL = 1e-6


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """torch's round-to-nearest-even bf16 bits of a float32 array, as uint16."""
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


def random_state(rng: np.random.Generator, n: int = N) -> tuple[np.ndarray, ...]:
    param = rng.standard_normal(n, dtype=np.float32)
    return param, np.zeros(n, np.float32), np.zeros(n, np.float32)


def assert_close(name: str, ours: np.ndarray, ref: np.ndarray, tol: float = TOL) -> None:
    diff = float(np.max(np.abs(ours.astype(np.float64) - ref.astype(np.float64))))
    assert diff <= tol, f"{name}: max abs diff {diff:.3g} > {tol:g}"


@pytest.mark.parametrize(
    ("decoupled", "grad_kind", "grad_scale", "beta1"),
    [
        (True, "fp32", 1.0, 0.9),
        (True, "fp32", 0.37, 0.3),  # lerp weight >= 0.5 takes torch's other lerp branch
        (True, "bf16", 1.0, 0.9),
        (True, "bf16", 1 / 3, 0.9),
        (False, "fp32", 1.0, 0.9),
        (False, "bf16", 0.37, 0.9),
    ],
)
def test_matches_torch(decoupled: bool, grad_kind: str, grad_scale: float, beta1: float) -> None:
    rng = np.random.default_rng(1234)
    param, exp_avg, exp_avg_sq = random_state(rng)
    hyper = {**HYPER, "beta1": beta1}
    param_t = torch.nn.Parameter(torch.from_numpy(param.copy()))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(
        [param_t],
        lr=hyper["lr"],
        betas=(beta1, hyper["beta2"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        foreach=False,
    )
    bf16_out = np.empty(N, np.uint16)
    for step in range(1, STEPS + 1):
        grad = rng.standard_normal(N, dtype=np.float32) * np.float32(0.1 * step)
        if grad_kind == "bf16":
            grad = to_bf16_bits(grad)
            grad_ref = bf16_bits_to_fp32(grad)
        else:
            grad_ref = grad.copy()
        param_t.grad = torch.from_numpy(grad_ref) * grad_scale  # float32 multiply, like ours
        opt.step()
        adamw_update(
            param,
            exp_avg,
            exp_avg_sq,
            grad,
            step=step,
            decoupled=decoupled,
            grad_scale=grad_scale,
            bf16_out=bf16_out,
            **hyper,
        )
        # bf16 copy of the new master, bitwise equal to torch's rounding of our master
        np.testing.assert_array_equal(bf16_out, to_bf16_bits(param))

    state = opt.state[param_t]
    assert_close("param", param, param_t.detach().numpy())
    assert_close("exp_avg", exp_avg, state["exp_avg"].numpy())
    assert_close("exp_avg_sq", exp_avg_sq, state["exp_avg_sq"].numpy())


def test_bf16_out_optional_does_not_change_update() -> None:
    rng = np.random.default_rng(7)
    a = random_state(rng)
    b = tuple(x.copy() for x in a)
    grad = rng.standard_normal(N, dtype=np.float32)
    out = np.empty(N, np.uint16)
    adamw_update(*a, grad, step=3, **HYPER)
    adamw_update(*b, grad, step=3, bf16_out=out, **HYPER)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(out, to_bf16_bits(b[0]))


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("grad_kind", ["fp32", "bf16"])
def test_sum_equals_presummed(rows: int, grad_kind: str) -> None:
    rng = np.random.default_rng(rows)
    n, pad, scale = 10_007, 37, 1 / rows
    buf = rng.standard_normal((rows, n + pad), dtype=np.float32)
    if grad_kind == "bf16":
        buf = to_bf16_bits(buf)
    grads = buf[:, :n]  # rows contiguous, row stride n + pad
    assert not grads.flags.c_contiguous
    values = bf16_bits_to_fp32(np.ascontiguousarray(grads)) if grad_kind == "bf16" else grads
    presummed = values[0] * np.float32(scale)
    for r in range(1, rows):
        presummed = presummed + values[r] * np.float32(scale)
    assert presummed.dtype == np.float32

    ours = random_state(rng, n)
    ref = tuple(x.copy() for x in ours)
    out_ours, out_ref = np.empty(n, np.uint16), np.empty(n, np.uint16)
    bf16_out = grad_kind == "bf16"  # the bf16 route also writes the bf16 param copy
    for step in (1, 2):
        adamw_update_sum(*ours, grads, step=step, grad_scale=scale, bf16_out=out_ours if bf16_out else None, **HYPER)
        adamw_update(*ref, presummed, step=step, bf16_out=out_ref if bf16_out else None, **HYPER)
    for x, y in zip(ours, ref):
        np.testing.assert_array_equal(x, y)
    if bf16_out:
        np.testing.assert_array_equal(out_ours, out_ref)


@pytest.mark.parametrize("kernel", ["adamw", "adamw_bf16_out"])
def test_kernels_vectorized(kernel: str) -> None:
    assert is_vectorized(kernel)


def test_is_vectorized_unknown_name() -> None:
    with pytest.raises(ValueError, match="unknown kernel"):
        is_vectorized("nope")


def _args(n: int = 8) -> dict:
    return {
        "param": np.zeros(n, np.float32),
        "exp_avg": np.zeros(n, np.float32),
        "exp_avg_sq": np.zeros(n, np.float32),
        "grad": np.zeros(n, np.float32),
    }


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"param": np.zeros(8, np.float64)}, TypeError, "param must have dtype float32"),
        ({"param": [0.0] * 8}, TypeError, "param must be a numpy.ndarray"),
        ({"grad": np.zeros(8, np.int16)}, TypeError, r"grad must have dtype .*view\(np.uint16\)"),
        ({"exp_avg": np.zeros(7, np.float32)}, ValueError, "exp_avg has length 7, expected 8"),
        ({"grad": np.zeros(16, np.float32)[::2]}, ValueError, "grad must be contiguous"),
        ({"exp_avg_sq": np.zeros((2, 4), np.float32)}, ValueError, "exp_avg_sq must be 1-D"),
        ({"bf16_out": np.zeros(8, np.float32)}, TypeError, "bf16_out must have dtype uint16"),
        ({"bf16_out": np.zeros(9, np.uint16)}, ValueError, "bf16_out has length 9"),
        ({"step": 0}, ValueError, "step must be >= 1"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"lr": -1e-3}, ValueError, "Invalid learning rate"),
        ({"lr": float("nan")}, ValueError, "Invalid learning rate"),
        ({"eps": -1.0}, ValueError, "Invalid epsilon"),
        ({"beta1": 1.0}, ValueError, "Invalid beta1"),
        ({"beta2": -0.1}, ValueError, "Invalid beta2"),
        ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be finite"),
        ({"lr": "0.1"}, TypeError, "lr must be a real number"),
    ],
)
def test_bad_input(change: dict, exc: type, match: str) -> None:
    kwargs = {**_args(), "step": 1, **HYPER, **change}
    with pytest.raises(exc, match=match):
        adamw_update(**kwargs)


def test_read_only_param_rejected() -> None:
    kwargs = {**_args(), "step": 1, **HYPER}
    kwargs["param"].flags.writeable = False
    with pytest.raises(ValueError, match="param is read-only"):
        adamw_update(**kwargs)


@pytest.mark.parametrize(
    ("grads", "match"),
    [
        (np.zeros(8, np.float32), "grads must be 2-D"),
        (np.zeros((2, 7), np.float32), r"grads must have shape \(R >= 1, 8\)"),
        (np.zeros((0, 8), np.float32), r"grads must have shape \(R >= 1, 8\)"),
        (np.zeros((2, 16), np.float32)[:, ::2], "each row of grads must be contiguous"),
        (np.zeros((8, 2), np.float32).T, "each row of grads must be contiguous"),
    ],
)
def test_sum_bad_grads(grads: np.ndarray, match: str) -> None:
    kwargs = _args()
    del kwargs["grad"]
    with pytest.raises(ValueError, match=match):
        adamw_update_sum(**kwargs, grads=grads, step=1, **HYPER)
