"""recipes.order: the training order is DistributedSampler's, and a resumed epoch starts after the batches done."""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from slidedp_lightning.recipes.order import ResumingSampler
from slidedp_lightning.recipes.settings import latest_checkpoint


def test_the_order_is_distributed_samplers_and_a_resumed_epoch_skips_the_done_batches():
    data = list(range(37))
    for rank in (0, 1):
        kw = {"num_replicas": 2, "rank": rank, "shuffle": True, "seed": 5, "drop_last": False}
        ours, theirs = ResumingSampler(data, batch_size=4, **kw), DistributedSampler(data, **kw)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
        ours.resume_at(epoch=1, batches=3)
        ours.set_epoch(1)
        assert list(ours) == list(theirs)[12:]  # epoch 1 after its first 3 batches of 4
        ours.set_epoch(2)
        theirs.set_epoch(2)
        assert list(ours) == list(theirs)  # later epochs whole


def test_the_latest_checkpoint_is_the_largest_step(tmp_path):
    assert latest_checkpoint(str(tmp_path / "none")) is None
    assert latest_checkpoint(str(tmp_path)) is None
    for name in ("step=9.ckpt", "step=12.ckpt", "step=100.ckpt.tmp", "other"):
        (tmp_path / name).mkdir()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=12.ckpt")


def test_a_resume_whose_flags_change_the_ledger_is_refused_naming_the_flag(tmp_path):
    import json

    from slidedp_lightning.recipes.settings import resume_problem
    from slidedp_lightning_cli.finetune import build_parser

    ck = tmp_path / "step=6.ckpt"
    ck.mkdir()
    meta = {"slidedp": {"optimizer_state": "int8", "bf16_copy": True}, "hyper_parameters": {"lora": None}}
    (ck / "meta.json").write_text(json.dumps(meta))
    same = build_parser().parse_args(["--optimizer-state", "int8"])
    assert resume_problem(same, str(ck)) is None
    for argv, said in (
        ([], "written with --optimizer-state int8, this run has --optimizer-state fp32"),
        (["--optimizer-state", "int8", "--no-bf16-copy"], "written with --bf16-copy on, this run has --bf16-copy off"),
        (["--optimizer-state", "int8", "--lora-r", "8"], "written with --lora-r none, this run has --lora-r 8"),
    ):
        problem = resume_problem(build_parser().parse_args(argv), str(ck))
        assert problem is not None and said in problem and f"--resume {ck}" in problem, problem
    assert resume_problem(same, str(tmp_path / "a-full-checkpoint.ckpt")) is None  # no meta.json: the strategy checks
