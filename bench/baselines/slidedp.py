"""SlideDP (shared ledger) and its replicated SlideFormer-style mode (``param_route="replicated"``).

``spec.knobs`` are ``SlideDPStrategy`` arguments, except ``loss_chunk`` (tokens per chunk of the loss, applied to
the model with :func:`slidedp_lightning.use_chunked_loss`), ``lane_trace`` (true: record the lanes with
:class:`slidedp_lightning.LaneTrace` into ``<out>/trace``) and ``state_on_disk`` (true: the moments in a state file
in ``<out>/state``, ``optimizer_state=StateOnDisk(...)`` with the ``optimizer_state`` knob as its moments; with
``master_on_disk`` true, the FP32 master there too).
"""

from __future__ import annotations

import os
from datetime import timedelta

from bench.baselines import lit
from bench.baselines.workload import JobSpec

DEFAULT_KNOBS = {"grad_route": "gpu_reduce", "param_route": "full", "chunk_bytes": None, "prefetch_window": 2}


def run(spec: JobSpec, out: str) -> int:
    """Train ``spec``; returns the global rank."""
    from slidedp_lightning import SlideDPStrategy

    knobs = {**DEFAULT_KNOBS, **spec.knobs}
    if spec.system == "replicated":
        knobs.update(param_route="replicated", grad_route="gpu_reduce")
    loss_chunk = knobs.pop("loss_chunk", None)
    trace = knobs.pop("lane_trace", False)
    activations = knobs.pop("activation_policy", "full" if spec.checkpointing else None)
    master = knobs.pop("master_on_disk", False)
    if knobs.pop("state_on_disk", False):
        from slidedp_lightning import StateOnDisk

        os.makedirs(f"{out}/state", exist_ok=True)
        moments = knobs.get("optimizer_state", "fp32")
        knobs["optimizer_state"] = StateOnDisk(f"{out}/state", moments=moments, master=master)
    strategy = SlideDPStrategy(**knobs, activation_policy=activations, timeout=timedelta(seconds=spec.timeout_s))
    callbacks = []
    if trace:
        from slidedp_lightning import LaneTrace

        callbacks.append(LaneTrace(f"{out}/trace"))
    trainer, module = lit.fit(
        spec, strategy, out, hf_checkpointing=False, fused_adamw=False, loss_chunk=loss_chunk, callbacks=callbacks
    )
    device = module.rec.extra.pop("device_memory", None)
    module.rec.write(
        device, "SlideDP runtime accounting (resident unit parameters + retained activations + pooled gradient buffers)"
    )
    return trainer.global_rank
