"""recipes.order: the training order is DistributedSampler's, and a resumed epoch starts after the batches done."""

from __future__ import annotations

from torch.utils.data import DistributedSampler

from slidedp_lightning.recipes.job import latest_checkpoint
from slidedp_lightning.recipes.order import ResumingSampler


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
