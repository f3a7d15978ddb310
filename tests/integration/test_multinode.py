"""Two "hosts" x 2 ranks on this machine (one launcher and one ledger per node rank, gloo): SlideDP keeps a
full ledger on each host and equals DDP + AdamW over all 4 ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import (
    BATCH,
    RTOL,
    STEPS,
    JobResult,
    compare_runs,
    run_nodes,
    shm_files,
    variant_result,
    variants_job,
)

pytestmark = pytest.mark.slow  # multi-process jobs


LAYOUTS = {
    # name: (strategy knobs, share of a full ledger each host's file holds after training)
    "replicated-full": ({"param_route": "full"}, 1.0),
    "replicated-sharded-chunks": ({"param_route": "sharded", "chunk_bytes": 4096}, 1.0),
    "host-sharded": ({"param_route": "sharded", "host_layout": "sharded"}, 0.5),
    # a frozen part of a block: its unit's moments cover the trainable prefix, which lies on the first host only
    "host-sharded-frozen-attention": (
        {"param_route": "sharded", "host_layout": "sharded", "freeze": ["model.layers.0.self_attn."]},
        0.5,
    ),
}


def _frozen(freeze: tuple[str, ...]) -> str:
    return "frozen_" + "_".join(freeze) if freeze else "plain"


@pytest.fixture(scope="module")
def references(job_runner):
    """``references(freeze)``: DDP over 4 ranks with those parameters frozen, a variant of one job fitting every
    set of frozen parameters the layouts use."""
    sets = {tuple(knobs.get("freeze", ())) for knobs, _ in LAYOUTS.values()}
    variants = {_frozen(f): {"freeze": list(f) or None} for f in sorted(sets)}
    common = dict(strategy="ddp", devices=4, tied=True, steps=STEPS, batch=BATCH)
    job = variants_job(job_runner, "ref_ddp_4ranks", variants, **common)

    def get(freeze: tuple[str, ...] = ()) -> JobResult:
        ref = variant_result(job, _frozen(freeze))
        assert ref.returncode == 0, ref.output[-3000:]
        return ref

    return get


def _layout_knobs(layout: str) -> dict:
    """The layout's strategy knobs; host-sharded, a checkpoint after the last step (no host holds whole weights to
    restore, the checkpoint has them)."""
    knobs = LAYOUTS[layout][0]
    return {**knobs, "save_at": STEPS} if knobs.get("host_layout") == "sharded" else knobs


@pytest.fixture(scope="module")
def layouts_job(tmp_path_factory) -> JobResult:
    """One job over 2 "hosts" fitting every layout in turn (a variant each: a job's start is most of its time)."""
    return run_nodes(
        tmp_path_factory.mktemp("layouts"),
        nodes=2,
        strategy="slidedp",
        devices=2,
        tied=True,
        steps=STEPS,
        batch=BATCH,
        variants={layout: _layout_knobs(layout) for layout in sorted(LAYOUTS)},
        keep_going=True,
        timeout=900,
    )


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test reads the checkpoint in one process
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_nodes_of_two_ranks_equal_ddp_on_four(layouts_job, references, layout):
    knobs, share = _layout_knobs(layout), LAYOUTS[layout][1]
    reference = references(tuple(knobs.get("freeze", ())))
    host_sharded = knobs.get("host_layout") == "sharded"
    res = variant_result(layouts_job, layout)
    assert res.returncode == 0, res.output[-5000:]
    if host_sharded:
        for r in range(4):
            a, b = reference.losses(r), res.losses(r)
            assert len(a) == len(b) == STEPS
            assert max(abs(x - y) / abs(x) for x, y in zip(a, b)) <= RTOL, f"rank {r}: losses differ from DDP"
        from slidedp_lightning.checkpoints.distributed import read_meta
        from slidedp_lightning.checkpoints.ranges import read_ranges

        want = reference.state()
        names = list(read_meta(res.out / "ck")["slidedp"]["params"])
        got = {f"model/{n}": torch.empty(want[n].shape) for n in names}
        read_ranges(res.out / "ck", [(k, 0, t.numel(), t.view(-1)) for k, t in got.items()], no_dist=True)
        assert sorted(names) == sorted(set(want) - {"model.lm_head.weight"})  # tied: saved once, as the embedding
        for n in names:
            rel = ((got[f"model/{n}"] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)).item()
            assert rel <= RTOL, f"{n}: final weights differ from DDP's by {rel:.2e} relative"
    else:
        compare_runs(reference, res, ranks=4)
    for rank in (0, 2):  # one rank per host
        info = json.loads((res.out / f"allocated_rank{rank}.json").read_text())
        held = info["allocated"] / info["nbytes"]
        assert abs(held - share) <= 0.08, f"host of rank {rank} holds {held:.2f} of a ledger, expected {share}"
    # one ledger per host, mapped by that host's two ranks, each holding the whole state (1x per host)
    mapped = [{tuple(m) for m in res.ledger(r)["mapped"]} for r in range(4)]  # (device, inode, path)
    assert mapped[0] == mapped[1] and mapped[2] == mapped[3] and not mapped[0] & mapped[2]
    assert all(len(m) == 1 for m in mapped)
    info = res.ledger(0)
    assert info["nbytes"] >= 14 * info["num_params"]
    assert not shm_files(), "a shared-memory ledger file was left behind"


def _continues(straight, resumed, start: int) -> None:
    ref, got = straight.losses(0)[start:], resumed.losses(0)
    assert len(got) == len(ref) > 0
    assert max(abs(x - y) / abs(y) for x, y in zip(got, ref)) <= 1e-6, (got, ref)


@pytest.mark.integration
def test_checkpoints_resume_across_host_layouts(tmp_path):
    """Host-sharded 2 x 2 saves at step 3 (each host writes its 1/N of every parameter as chunks); that checkpoint
    resumes on host-sharded 2 x 1 (other host boundaries) and on one host of 2 ranks; the one-host run saves at
    step 4 and host-sharded 2 x 2 resumes from it. Every resumed run continues the straight run's losses."""
    from tests.integration.conftest import run_job

    common = dict(strategy="slidedp", tied=True, batch=BATCH, constant_data=True, steps=6)
    sharded = dict(param_route="sharded", host_layout="sharded")
    straight = run_nodes(tmp_path / "straight", nodes=2, devices=2, save_at=3, **sharded, **common)
    assert straight.returncode == 0, straight.output[-4000:]
    ck = str(straight.out / "ck")
    fewer = run_nodes(tmp_path / "fewer", nodes=2, devices=1, ckpt_path=ck, **sharded, **common)
    assert fewer.returncode == 0, fewer.output[-4000:]
    _continues(straight, fewer, 3)
    one = run_job(tmp_path / "one", devices=2, ckpt_path=ck, save_at=4, param_route="full", **common)
    assert one.returncode == 0, one.output[-4000:]
    _continues(straight, one, 3)
    back = run_nodes(tmp_path / "back", nodes=2, devices=2, ckpt_path=str(one.out / "ck"), **sharded, **common)
    assert back.returncode == 0, back.output[-4000:]
    _continues(straight, back, 4)
    assert not shm_files(), "a shared-memory ledger file was left behind"
    # the host-sharded checkpoint (whose values the resumed runs above checked) exports offline, in one process
    from transformers import AutoModelForCausalLM

    from slidedp_lightning.hf.export import export_checkpoint

    export_checkpoint(ck, tmp_path / "hf", "fp32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(8)[None]).logits).all()
