"""experiments/table_*.py: importing runs nothing, and each parses ``--help``; capacity_steptime.py predicts its job."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("table_*.py"))


def load(path: Path):
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(f"experiments_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_script_per_paper_table():
    names = {p.stem for p in SCRIPTS}
    assert names == {
        f"table_{t}"
        for t in (
            "throughput",
            "memory",
            "host_slope",
            "scaling",
            "chunking",
            "autopolicy",
            "routes",
            "loss_equivalence",
        )
    }


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_help(path: Path, capsys):
    module = load(path)
    assert module.PAPER.strip()
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--scale" in out and "--ranks" in out and "--quick" in out


def test_the_capacity_step_is_predicted_for_both_states_on_disk(tmp_path):
    from bench.capacity import QWEN3_1_7B, SEQ
    from slidedp_lightning.steptime.profiles import Profile, load_profile

    module = load(EXPERIMENTS / "capacity_steptime.py")
    QWEN3_1_7B.with_layers(4).hf_config(SEQ).save_pretrained(tmp_path)  # the checkpoint's config.json
    base = load_profile("rtx4090x4")  # the job has 2 ranks
    times = {}
    for gbps in (1e-2, 1e3):
        profile = Profile(base.name, {**base.values, "disk_gbps": gbps}, base.sources)
        for label in ("slidedp_disk", "slidedp_disk_master"):
            sim = module.predicted(label, tmp_path, profile)
            times[label, gbps] = sim.step_time, sim.bottleneck, sim.busy
    # on a slow disk the step is the disk's: the master's 6 B/param each way against the FP32 moments' 8
    assert all(t > 0 for t, _, _ in times.values())
    assert times["slidedp_disk", 1e-2][1] == times["slidedp_disk_master", 1e-2][1] == "host-bound (disk)"
    assert times["slidedp_disk_master", 1e-2][0] < times["slidedp_disk", 1e-2][0]
    assert times["slidedp_disk", 1e3][0] < times["slidedp_disk", 1e-2][0]
    # the disk lane is the one a slow disk lengthens, and on a slow disk it is most of the step
    slow, fast = times["slidedp_disk", 1e-2][2], times["slidedp_disk", 1e3][2]
    assert slow["disk"] > 10 * fast["disk"] and slow["disk"] > 0.5 * times["slidedp_disk", 1e-2][0]


def test_the_capacity_lane_table_puts_each_traced_lane_beside_the_model():
    module = load(EXPERIMENTS / "capacity_steptime.py")
    rows = module.lane_table(
        {"compute": 20.0, "update": 4.0, "disk": 0.0}, {"compute": 18.0, "update": 5.0, "disk": 2.0}
    )
    assert rows[2:] == [
        "| compute | 20.00 | 18.00 | 0.90 |",
        "| update | 4.00 | 5.00 | 1.25 |",
        "| disk | 0 | 2.00 | - |",
    ]
