"""AutoPolicy: probe the offload links, calibrate each checkpointing mode on a real block, solve, report.

Runs once, inside the first training forward of the first decoder block (the real batch and sequence shapes
are known there), on every rank at once: each rank measures, the costs are max-reduced so every rank solves
the same program, and rank 0's plan is broadcast. The routes were already chosen by the route probe of the
engine (``"auto"``) or by the user; the plan records them, so a saved plan JSON reproduces the whole setup
without probing again (``SlideDPStrategy(activation_policy="plan.json")``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from slidedp_lightning.autopolicy.solve import Fixed, InfeasibleBudget, Option, predict, solve
from slidedp_lightning.runtime.activation_policy import ActivationPolicy, UnitPolicy

log = logging.getLogger(__name__)

MODES = ("none", "selective", "segments:1111111", "segments:1010101", "segments:0100100", "full")
RATIOS = (0.0, 0.5, 1.0)
BASELINE = "full"  # what a streaming runtime does without AutoPolicy: the break-even is measured against it


@dataclass
class Plan:
    """The chosen per-block policy, the routes it was planned for, and the report of how it was chosen."""

    activations: ActivationPolicy
    routes: dict
    report: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"activations": self.activations.to_dict(), "routes": self.routes, "report": self.report}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


class AutoPolicy:
    """The planner an engine calls at its first training forward (see the module docstring).

    Args:
        memory_budget: device bytes for parameters + retained activations; a float in (0, 1] is a fraction of
            the device's memory (CUDA only); None = 90 % of the device's memory on CUDA, unlimited on CPU.
        profile: a steptime hardware profile (name or JSON path) describing this machine; it supplies the
            step's fixed host work (parameter and gradient transfers, CPU update). Without it only the offload
            traffic is charged to the host links.
        modes, ratios: the candidates: every mode with every offload ratio.
        save_to: where rank 0 writes the plan JSON.
    """

    def __init__(
        self,
        memory_budget: int | float | None = None,
        profile: str | Path | None = None,
        modes: tuple[str, ...] = MODES,
        ratios: tuple[float, ...] = RATIOS,
        save_to: str | Path | None = None,
        repeats: int = 2,
    ) -> None:
        if memory_budget is not None and (not isinstance(memory_budget, (int, float)) or memory_budget <= 0):
            raise ValueError(
                f"memory_budget must be bytes (int > 0), a fraction in (0, 1] or None; got {memory_budget!r}"
            )
        if isinstance(memory_budget, float) and memory_budget > 1:
            raise ValueError(f"a float memory_budget is a fraction of device memory in (0, 1]; got {memory_budget}")
        self.candidates = [UnitPolicy.parse(f"{m}@{r:g}") for m in modes for r in ratios]  # validates them
        self.modes = tuple(modes)
        self.ratios = tuple(ratios)
        self.memory_budget = memory_budget
        self.profile = profile
        self.save_to = save_to
        self.repeats = repeats
        self.plan: Plan | None = None

    # -- the planner call ---------------------------------------------------------------------------
    def __call__(self, engine, u: int, args: tuple, kwargs: dict) -> ActivationPolicy:
        t0 = time.perf_counter()
        group = engine.topology.shard_group
        x = args[0]
        budget = self._budget(engine)
        rates = self._probe_links(x, engine.lanes.device, group)
        measured = {
            m: engine.activations.measure(u, UnitPolicy.parse(m), args, kwargs, self.repeats) for m in self.modes
        }
        measured = _max_over_ranks(measured, group)
        options = self._options(measured)
        fixed = self._fixed(engine, x, rates)
        blocks = [engine.layout.units[b].name for b in sorted(engine.activations.blocks)]
        try:
            choice = solve(blocks, options, fixed, budget)
        except InfeasibleBudget as err:
            smallest = err.needed + self._reserve(engine)
            raise ValueError(
                f"AutoPolicy: {err} The smallest feasible memory_budget is {smallest:,.0f} bytes "
                f"({smallest / 2**20:.2f} MiB); raise it, or lower the batch size or sequence "
                "length."
            ) from None
        policy = ActivationPolicy(UnitPolicy(), {b: UnitPolicy.parse(o.policy) for b, o in zip(blocks, choice)})
        search_s = time.perf_counter() - t0
        baseline = next(o for o in options if o.policy == f"{BASELINE}@0")
        report = self._report(measured, options, choice, blocks, fixed, budget, baseline, search_s, x, engine)
        plan = Plan(
            policy,
            {
                "param_route": engine.config.param_route,
                "grad_route": engine.config.grad_route,
                "chunk_bytes": engine.config.chunk_bytes,
            },
            report,
        )
        if group is not None:  # every rank runs rank 0's plan, whatever rounding did elsewhere
            box = [plan.to_dict()]
            dist.broadcast_object_list(box, group=group, group_src=0)
            plan = Plan(ActivationPolicy.from_dict(box[0]["activations"]), box[0]["routes"], box[0]["report"])
        self.plan = plan
        if engine.topology.global_rank == 0:
            self._log(plan)
            if self.save_to:
                plan.save(self.save_to)
                log.info(
                    "AutoPolicy plan saved to %s (reuse it with activation_policy=%r)", self.save_to, str(self.save_to)
                )
        return plan.activations

    # -- the steps --------------------------------------------------------------------------------------
    def _budget(self, engine) -> float:
        """Device bytes left for retained activations: the budget minus the streamed parameters' worst case
        (the prefetch window plus the unit in use, and one unit's FP32 gradient)."""
        device = engine.lanes.device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            budget = (
                total * 0.9
                if self.memory_budget is None
                else (total * self.memory_budget if isinstance(self.memory_budget, float) else self.memory_budget)
            )
        elif isinstance(self.memory_budget, float):
            raise ValueError("a fractional memory_budget needs a CUDA device; give bytes on the CPU.")
        else:
            budget = math.inf if self.memory_budget is None else self.memory_budget
        return budget - self._reserve(engine)

    @staticmethod
    def _reserve(engine) -> int:
        itemsize = torch.empty(0, dtype=engine.compute_dtype).element_size()
        return (engine.config.prefetch_window + 1) * engine.layout.max_unit * itemsize + engine.layout.max_unit * 4

    def _options(self, measured: dict[str, dict[str, float]]) -> list[Option]:
        """Every mode with every offload ratio. A checkpointing mode does the work of ``none`` plus its
        recompute, so a measurement below ``none``'s is noise: it is raised to ``none``'s time (plus 0.1 %)."""
        floor = measured["none"]["seconds"] if "none" in measured else 0.0
        out = []
        for m, c in measured.items():
            seconds = c["seconds"] if m == "none" else max(c["seconds"], floor * 1.001)
            for r in self.ratios:
                kept = c["retained_bytes"]
                out.append(Option(f"{m}@{r:g}", seconds, round(kept * (1 - r)), round(kept * r)))
        return out

    def _probe_links(self, x: torch.Tensor, device: torch.device, group) -> tuple[float, float]:
        """Bytes/s of device->host and host->device copies of an activation-sized tensor, all ranks at once."""
        n = max(x.numel() * 4, 1 << 16)
        dev = torch.empty(n, dtype=x.dtype, device=device)
        host = torch.empty(n, dtype=x.dtype, pin_memory=device.type == "cuda")
        rates = []
        for dst, src in ((host, dev), (dev, host)):
            times = []
            for _ in range(4):
                if group is not None:
                    dist.barrier(group=group)
                _sync(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                _sync(device)
                times.append(time.perf_counter() - t0)
            rates.append(n * x.element_size() / statistics.median(times[1:]))
        vec = torch.tensor([1.0 / r for r in rates], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        return 1.0 / float(vec[0]), 1.0 / float(vec[1])

    def _fixed(self, engine, x: torch.Tensor, rates: tuple[float, float]) -> Fixed:
        d2h_rate, h2d_rate = rates
        if self.profile is None:
            return Fixed(h2d_rate=h2d_rate, d2h_rate=d2h_rate)
        from slidedp_lightning.steptime.analytic import analyze
        from slidedp_lightning.steptime.graph import StepConfig
        from slidedp_lightning.steptime.profiles import load_profile
        from slidedp_lightning.steptime.workload import UnitActivation, load_config

        profile = load_profile(self.profile)
        cfg = StepConfig(
            model=load_config(engine.model.config),
            batch=x.shape[0],
            seq=x.shape[1],
            gpus=engine.topology.shard_world,
            param_route=engine.config.param_route,
            grad_route=engine.config.grad_route,
            chunk_bytes=engine.config.chunk_bytes,
            prefetch_window=engine.config.prefetch_window,
            activation=UnitActivation(),
            precision="bf16-mixed" if engine.compute_dtype == torch.bfloat16 else "32-true",
            optimizer_state=engine.config.optimizer_state,
            bf16_copy=engine.config.bf16_copy,
            h2d_convert=engine.config.h2d_convert,
        )
        bounds = analyze(cfg, profile).bounds
        return Fixed(
            h2d=bounds.get("h2d", 0.0),
            d2h=bounds.get("d2h", 0.0),
            host=max(bounds.get("cpu", 0.0), bounds.get("dram", 0.0)),
            h2d_rate=h2d_rate,
            d2h_rate=d2h_rate,
        )

    def _report(self, measured, options, choice, blocks, fixed, budget, baseline, search_s, x, engine) -> dict:
        planned = predict(choice, fixed)
        base = predict([baseline] * len(blocks), fixed)
        saving = base["step"] - planned["step"]
        return {
            "shape": {
                "batch": x.shape[0],
                "seq": x.shape[1],
                "ranks": engine.topology.shard_world,
                "blocks": len(blocks),
            },
            "budget_bytes": budget if math.isfinite(budget) else None,
            "link_bytes_per_s": {"d2h": fixed.d2h_rate, "h2d": fixed.h2d_rate},
            "fixed_seconds": {"gpu": fixed.gpu, "h2d": fixed.h2d, "d2h": fixed.d2h, "host": fixed.host},
            "profile": str(self.profile) if self.profile else None,
            "measured": measured,
            "options": [o.__dict__ for o in options],
            "plan": dict(zip(blocks, (o.policy for o in choice))),
            "predicted": planned,
            "baseline": {"policy": baseline.policy, "predicted": base},
            "retained_bytes": sum(o.retained_bytes for o in choice),
            "search_seconds": search_s,
            "saving_seconds_per_step": saving,
            "break_even_steps": search_s / saving if saving > 0 else None,
        }

    def _log(self, plan: Plan) -> None:
        r = plan.report
        costs = "; ".join(
            f"{m}: {c['seconds'] * 1e3:.2f} ms, {c['retained_bytes'] / 2**20:.2f} MiB" for m, c in r["measured"].items()
        )
        chosen: dict[str, int] = {}
        for p in r["plan"].values():
            chosen[p] = chosen.get(p, 0) + 1
        even = f"{r['break_even_steps']:.0f} steps" if r["break_even_steps"] else f"never (not faster than {BASELINE})"
        log.info(
            "AutoPolicy: measured per block (max over ranks) %s. Plan: %s; predicted step %.2f ms (%s: %.2f ms), "
            "retained %.2f MiB of a %s budget; search %.2f s, pays back after %s.",
            costs,
            ", ".join(f"{p} x{n}" for p, n in chosen.items()),
            r["predicted"]["step"] * 1e3,
            BASELINE,
            r["baseline"]["predicted"]["step"] * 1e3,
            r["retained_bytes"] / 2**20,
            f"{r['budget_bytes'] / 2**20:.2f} MiB" if r["budget_bytes"] is not None else "unlimited",
            r["search_seconds"],
            even,
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(measured: dict[str, dict[str, float]], group) -> dict[str, dict[str, float]]:
    if group is None:
        return measured
    keys = [(m, k) for m in sorted(measured) for k in sorted(measured[m])]
    vec = torch.tensor([float(measured[m][k]) for m, k in keys], dtype=torch.float64)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    out = {m: dict(c) for m, c in measured.items()}
    for (m, k), v in zip(keys, vec.tolist()):
        out[m][k] = v
    return out
