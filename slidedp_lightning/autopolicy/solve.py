"""The integer program: one option per block, minimizing the modeled step time under a device memory budget.

Linearized step-time model (docs/STEPTIME.md): the step is at least the work of each resource,

    T >= gpu_fixed + sum_u,o x[u,o] * seconds[o]                        (compute, recompute included)
    T >= h2d_fixed + sum_u,o x[u,o] * offloaded_bytes[o] / h2d_rate     (reloads share the H2D link)
    T >= d2h_fixed + sum_u,o x[u,o] * offloaded_bytes[o] / d2h_rate     (offloads share the D2H link)
    T >= host_fixed                                                     (CPU update, DRAM)
    sum_o x[u,o] = 1,   sum_u,o x[u,o] * retained_bytes[o] <= budget

and minimizes T, then (a tie-break of 1e-4 of the step, below measurement noise) the offloaded bytes and the
compute: when the step is bound elsewhere, activations stay on the device and nothing is recomputed if the
budget allows it.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import pulp

log = logging.getLogger(__name__)


class InfeasibleBudget(ValueError):
    """No assignment of options fits the budget; ``needed`` is the smallest budget that fits."""

    def __init__(self, message: str, needed: float) -> None:
        super().__init__(message)
        self.needed = needed


@dataclass(frozen=True)
class Option:
    """One candidate for a block: its policy text and its measured (max over ranks) costs."""

    policy: str
    seconds: float  # forward + backward of one block, recompute included
    retained_bytes: int  # activation bytes kept on the device from forward to backward
    offloaded_bytes: int  # activation bytes moved to host memory and back


@dataclass
class Fixed:
    """Step work that no activation option changes (seconds), and the offload link rates (bytes/s)."""

    gpu: float = 0.0
    h2d: float = 0.0
    d2h: float = 0.0
    host: float = 0.0
    h2d_rate: float = math.inf
    d2h_rate: float = math.inf


def predict(choice: list[Option], fixed: Fixed) -> dict[str, float]:
    """The linearized model's resource times and step time for one option per block."""
    terms = {
        "gpu": fixed.gpu + sum(o.seconds for o in choice),
        "h2d": fixed.h2d + sum(o.offloaded_bytes for o in choice) / fixed.h2d_rate,
        "d2h": fixed.d2h + sum(o.offloaded_bytes for o in choice) / fixed.d2h_rate,
        "host": fixed.host,
    }
    terms["step"] = max(terms.values())
    return terms


def solve(blocks: list[str], options: list[Option], fixed: Fixed, budget: float) -> list[Option]:
    """The option of each block (same order as ``blocks``) minimizing the modeled step time within ``budget``
    retained device bytes; raises ValueError when no assignment fits."""
    least = min(o.retained_bytes for o in options)
    if least * len(blocks) > budget:
        raise InfeasibleBudget(
            f"no activation policy fits the device memory budget: even the most frugal option keeps "
            f"{least * len(blocks) / 2**20:.2f} MiB of activations for {len(blocks)} blocks, the budget leaves "
            f"{budget / 2**20:.2f} MiB for them.",
            least * len(blocks),
        )
    prob = pulp.LpProblem("slidedp_activation_policy", pulp.LpMinimize)
    x = {(b, k): prob.add_variable(f"x_{b}_{k}", cat="Binary") for b in range(len(blocks)) for k in range(len(options))}
    t = prob.add_variable("step_seconds", lowBound=0)
    moved = max(o.offloaded_bytes for o in options) * len(blocks) or 1
    work = max(o.seconds for o in options) * len(blocks) or 1
    tie = 1e-4 * work
    prob += t + tie * pulp.lpSum(
        x[b, k] * (options[k].offloaded_bytes / moved + options[k].seconds / work) for b, k in x
    )
    for b in range(len(blocks)):
        prob += pulp.lpSum(x[b, k] for k in range(len(options))) == 1
    picked = lambda f: pulp.lpSum(x[b, k] * f(options[k]) for b, k in x)  # noqa: E731
    prob += t >= fixed.gpu + picked(lambda o: o.seconds)
    if math.isfinite(fixed.h2d_rate):
        prob += t >= fixed.h2d + picked(lambda o: o.offloaded_bytes / fixed.h2d_rate)
    if math.isfinite(fixed.d2h_rate):
        prob += t >= fixed.d2h + picked(lambda o: o.offloaded_bytes / fixed.d2h_rate)
    prob += t >= fixed.host
    if math.isfinite(budget):  # no budget (a CPU run without one): nothing to constrain
        prob += picked(lambda o: o.retained_bytes) <= budget
    with warnings.catch_warnings():  # the CBC bundled with PuLP 3 announces its move to an extra
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        raise RuntimeError(f"the activation-policy integer program ended {pulp.LpStatus[status]!r}")
    return [next(options[k] for k in range(len(options)) if x[b, k].value() > 0.5) for b in range(len(blocks))]
