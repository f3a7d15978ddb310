"""``calibrate``'s compute probe times the model as the strategy runs it in the profile's precision."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from slidedp_lightning.steptime import calibrate


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{calibrate._free_port()}", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def test_the_compute_is_timed_in_the_precision_asked_for(one_rank, monkeypatch):
    """FP32 units for ``32-true``; BF16 units under BF16 autocast for ``bf16-mixed`` (every linear layer's output is
    BF16), in the runtime's traced lane and in the plain model's loss timing alike."""
    dtypes: set[torch.dtype] = set()
    new_model = calibrate._new_model

    def hooked(name: str):
        model = new_model(name)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, args, out: dtypes.add(out.dtype))
        return model

    monkeypatch.setattr(calibrate, "_new_model", hooked)
    monkeypatch.setattr(calibrate, "RUNTIME_STEPS", 4)  # traced steps per batch size, 1 of them warm-up
    monkeypatch.setattr(calibrate, "RUNTIME_WARMUP", 1)
    for precision, dtype in (("32-true", torch.float32), ("bf16-mixed", torch.bfloat16)):
        dtypes.clear()
        got = calibrate._compute("qwen3-tiny", 26, (8, 32), one_rank, 1, precision)
        assert dtypes == {dtype}, (precision, dtypes)
        assert all(math.isfinite(v) for v in got.values()) and got["gpu_flops"] > 0, got
    with pytest.raises(ValueError, match="one of"):
        calibrate.measure(1, precision="16-mixed")
