"""Plots of a benchmark results directory, drawn from its ``results.json`` (PNG, matplotlib's Agg backend).

``python -m bench.plots RESULTS_DIR`` redraws them from the recorded data. Written into ``RESULTS_DIR/plots``:

* ``throughput.png``: tokens/s against model size, one line per system (the systems table);
* ``host_memory.png``: training-step host peak against parameters, with each system's least-squares line and its
  slope in GB per billion parameters (the host-memory slope table);
* ``loss.png``: per-step loss of SlideDP and FSDP2 and their difference, per precision (loss equivalence);
* ``lanes_gantt.png``: SlideDP's lanes in one step, when a run recorded a lane trace.

A plot whose runs did not run (or did not finish) is not drawn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.baselines.workload import SYSTEMS, ModelShape
from bench.fit import slope

GB = 1e9


def _params(summary: dict) -> int:
    return ModelShape(**summary["spec"]["model"]).num_params


def _systems(runs: dict[str, dict]) -> dict[str, list[dict]]:
    """system -> its finished runs of the systems table, smallest model first."""
    out: dict[str, list[dict]] = {}
    for name, r in runs.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "systems" and r.get("status") == "ok":
            out.setdefault(parts[2], []).append(r)
    order = {s: i for i, s in enumerate(SYSTEMS)}
    return {s: sorted(out[s], key=_params) for s in sorted(out, key=lambda s: order.get(s, len(order)))}


def throughput_series(runs: dict[str, dict]) -> dict[str, list[tuple[float, float]]]:
    """system -> [(M params, tokens/s)] of the systems table's finished runs."""
    return {s: [(_params(r) / 1e6, r["tokens_per_s"]) for r in rs] for s, rs in _systems(runs).items()}


def host_series(runs: dict[str, dict]) -> dict[str, tuple[list[float], list[float], float | None, float | None]]:
    """system -> (billions of params, host peak GB, slope GB per B, intercept GB); no line below two sizes."""
    out = {}
    for s, rs in _systems(runs).items():
        xs = [_params(r) / 1e9 for r in rs if r.get("host_peak")]
        ys = [r["host_peak"] / GB for r in rs if r.get("host_peak")]
        if not xs:
            continue
        b, a = slope(xs, ys) if len(set(xs)) >= 2 else (None, None)
        out[s] = (xs, ys, b, a)
    return out


def loss_series(runs: dict[str, dict]) -> dict[str, dict[str, list[float]]]:
    """precision -> system -> per-step loss, for the loss-equivalence runs that finished."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, r in runs.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "loss" and r.get("status") == "ok" and r.get("losses"):
            out.setdefault(parts[1], {})[parts[2]] = r["losses"]
    return out


def trace_file(runs: dict[str, dict]) -> Path | None:
    for r in runs.values():
        path = r.get("extra", {}).get("lane_trace")
        if path and Path(path).exists():
            return Path(path)
    return None


def gantt_spans(trace: dict, step: int | None = None):
    """The spans of one step of a Chrome trace written by SlideDP's tracer (default: its third step, else its
    last), and that step's start and end (seconds; its ``step`` window event where the trace has one, else its
    compute spans' extent): ``(spans, start, end, step)``."""
    from slidedp_lightning.runtime.trace import Span

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "step" in e.get("args", {})]
    steps = sorted({e["args"]["step"] for e in events})
    if not steps:
        return [], 0.0, 0.0, -1
    if step is None:
        step = steps[2] if len(steps) > 2 else steps[-1]
    mine = [e for e in events if e["args"]["step"] == step]
    spans = []
    for e in mine:
        if e["cat"] != "step":
            unit, chunk = e["args"].get("unit", -1), e["args"].get("chunk", -1)
            spans.append(Span(e["cat"], e["name"], step, unit, chunk, e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    window = [e for e in mine if e["cat"] == "step"]
    if window:
        return spans, window[0]["ts"] / 1e6, (window[0]["ts"] + window[0]["dur"]) / 1e6, step
    compute = [s for s in spans if s.lane == "compute"] or spans
    return spans, min(s.start for s in compute), max(s.end for s in compute), step


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_throughput(series: dict[str, list[tuple[float, float]]], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for system, points in series.items():
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=system)
    ax.set_xlabel("model size, M parameters")
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title("Throughput at matched batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_host_memory(series: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = plt.get_cmap("tab10")
    for i, (system, (xs, ys, b, a)) in enumerate(series.items()):
        label = system if b is None else f"{system}: {b:.1f} GB per B params"
        ax.scatter([x * 1e3 for x in xs], ys, color=colors(i), label=label, zorder=3)
        if b is not None:
            lo, hi = min(xs), max(xs)
            ax.plot([lo * 1e3, hi * 1e3], [a + b * lo, a + b * hi], color=colors(i), lw=1)
    ax.set_xlabel("model size, M parameters")
    ax.set_ylabel("host peak, GB (PSS sum, training steps)")
    ax.set_title("Host memory against parameters (least-squares lines)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_loss(series: dict[str, dict[str, list[float]]], path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(series), figsize=(5.5 * len(series), 6), squeeze=False)
    for col, (precision, by) in enumerate(series.items()):
        top, bottom = axes[0][col], axes[1][col]
        for system, losses in by.items():
            top.plot(range(len(losses)), losses, label=system, lw=1)
        top.set_title(f"loss, {precision}")
        top.set_xlabel("step")
        top.legend(fontsize=8)
        top.grid(alpha=0.3)
        title = "|SlideDP - FSDP2|"
        if {"slidedp", "fsdp2"} <= set(by):
            diff = [abs(x - y) for x, y in zip(by["slidedp"], by["fsdp2"])]
            bottom.plot(range(len(diff)), [max(d, 1e-12) for d in diff], lw=1, color="k")
            bottom.set_yscale("log")
            title += f", max {max(diff):.3g}" + (" (a 0 is drawn at 1e-12)" if min(diff) == 0 else "")
        bottom.set_title(title)
        bottom.set_xlabel("step")
        bottom.grid(alpha=0.3)
    return _save(fig, path)


def plot_gantt(trace: Path, path: Path) -> Path | None:
    from slidedp_lightning.runtime.trace import Tracer

    spans, start, end, step = gantt_spans(json.loads(trace.read_text()))
    if not spans:
        return None
    fig = Tracer(None, rank=0).gantt(spans, start, end, step)
    return _save(fig, path)


def write_plots(out: Path, runs: dict[str, dict] | None = None) -> list[Path]:
    """Every plot the recorded runs allow, into ``out/plots``; ``runs`` defaults to ``out/results.json``'s."""
    if runs is None:
        js = out / "results.json"
        runs = json.loads(js.read_text())["runs"] if js.exists() else {}
    folder = out / "plots"
    written = []
    tp = throughput_series(runs)
    if tp:
        written.append(plot_throughput(tp, folder / "throughput.png"))
    host = host_series(runs)
    if host:
        written.append(plot_host_memory(host, folder / "host_memory.png"))
    loss = loss_series(runs)
    if loss:
        written.append(plot_loss(loss, folder / "loss.png"))
    trace = trace_file(runs)
    if trace is not None:
        gantt = plot_gantt(trace, folder / "lanes_gantt.png")
        if gantt is not None:
            written.append(gantt)
    return written


if __name__ == "__main__":
    for p in write_plots(Path(sys.argv[1])):
        print(p)
