"""The fine-tune CLI's SlideDP route flags reach the strategy."""

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.process.launcher import TrainerScriptLauncher
from slidedp_lightning.recipes.finetune import ComparisonDDP, chunked_loss, strategy_for
from slidedp_lightning.recipes.settings import MODEL_CHUNKED_LOSS
from slidedp_lightning_cli.finetune import build_parser


def test_route_flags_configure_the_strategy():
    args = build_parser().parse_args(
        ["--param-route", "sharded", "--grad-route", "host_reduce", "--chunk-bytes", "4096"]
    )
    s = strategy_for(args)
    assert isinstance(s, SlideDPStrategy)
    assert (s.options.param_route, s.options.grad_route, s.options.chunk_bytes) == ("sharded", "host_reduce", 4096)


def test_defaults_keep_the_registered_strategy(tmp_path):
    argv = ["--model", str(tmp_path), "--activation-policy", "none"]
    assert strategy_for(build_parser().parse_args(argv)) == "slidedp"
    for argv in (["--strategy", "ddp"], ["--strategy", "ddp", "--model", str(tmp_path)]):
        ddp = strategy_for(build_parser().parse_args(argv))  # Lightning's "ddp", its launcher taking over early ranks
        assert type(ddp) is ComparisonDDP and ddp._start_method == "popen"
        ddp.cluster_environment = LightningEnvironment()
        ddp._configure_launcher()
        assert type(ddp.launcher) is TrainerScriptLauncher


def test_a_real_model_gets_full_recomputation_and_the_chunked_loss_unless_turned_off(tmp_path):
    args = build_parser().parse_args(["--model", str(tmp_path)])
    s = strategy_for(args)
    assert isinstance(s, SlideDPStrategy) and s.options.activation_policy == "full" and not s.options.meta_init
    assert chunked_loss(args) == MODEL_CHUNKED_LOSS > 0
    off = build_parser().parse_args(["--model", str(tmp_path), "--activation-policy", "none", "--chunked-loss", "0"])
    assert strategy_for(off) == "slidedp" and chunked_loss(off) == 0
    assert chunked_loss(build_parser().parse_args([])) == 0  # the tiny synthetic model: the model's own loss


def test_the_strategy_flags_reach_the_strategy():
    argv = ["--optimizer-state", "int8", "--no-bf16-copy", "--activation-policy", "selective@0.5"]
    s = strategy_for(build_parser().parse_args([*argv, "--update-threads", "1"]))
    assert isinstance(s, SlideDPStrategy)
    o = s.options
    assert (o.optimizer_state, o.bf16_copy, o.activation_policy, o.update_threads) == (
        "int8",
        False,
        "selective@0.5",
        1,
    )


def test_a_policy_the_strategy_refuses_is_refused_before_any_process():
    with pytest.raises(ValueError, match="segment"):
        strategy_for(build_parser().parse_args(["--activation-policy", "segments:01"]))


def test_the_random_init_model_is_built_on_meta():
    """SlideDP's advice for random weights: meta_init (each unit initialized into the ledger), not a model
    materialized on every rank."""
    s = strategy_for(build_parser().parse_args([]))
    assert isinstance(s, SlideDPStrategy) and s.options.meta_init
    assert (s.options.param_route, s.options.grad_route, s.options.chunk_bytes) == ("full", "gpu_reduce", None)


@pytest.mark.parametrize("argv", [["--param-route", "ring"], ["--chunk-bytes", "0"], ["--chunk-bytes", "big"]])
def test_bad_flags(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def test_max_epochs_becomes_the_steps_of_that_many_passes():
    from slidedp_lightning.recipes.job import _max_steps
    from slidedp_lightning.recipes.module import FinetuneModule
    from slidedp_lightning.recipes.settings import DEFAULT_MAX_STEPS, TRAIN_SIZE

    module = FinetuneModule(batch_size=32)
    assert module.batches_per_epoch(2) == TRAIN_SIZE // 2 // 32  # 312 batches of 32 a rank
    parse = build_parser().parse_args
    assert _max_steps(parse(["--max-epochs", "2"]), module) == 2 * 312
    assert (
        _max_steps(parse(["--max-epochs", "2", "--accumulate-grad-batches", "5"]), module) == 2 * 63
    )  # 62.4: the last partial
    assert _max_steps(parse(["--max-steps", "7"]), module) == 7
    assert _max_steps(parse([]), module) == DEFAULT_MAX_STEPS


def test_the_random_init_model_is_built_on_the_meta_device_unless_no_meta_init():
    s = strategy_for(build_parser().parse_args([]))
    assert isinstance(s, SlideDPStrategy) and s.options.meta_init
    # nothing differs from the strategy's defaults (meta_init off): the registered strategy
    assert strategy_for(build_parser().parse_args(["--no-meta-init"])) == "slidedp"
    s = strategy_for(build_parser().parse_args(["--no-meta-init", "--optimizer-state", "int8"]))
    assert isinstance(s, SlideDPStrategy) and not s.options.meta_init and s.options.optimizer_state == "int8"


def test_the_command_exits_with_the_jobs_status_and_its_heap_left_out_of_the_exit_collections(monkeypatch):
    """``slidedp-finetune`` (each rank runs it) is :func:`cli`: the status of :func:`main`, the heap frozen first
    so that the interpreter's exit does not collect it again (2-3 s a rank with torch, Lightning and transformers)."""
    import gc
    from importlib.metadata import entry_points

    from slidedp_lightning_cli import finetune

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "slidedp-finetune"]
    assert script.value == "slidedp_lightning_cli.finetune:cli"
    monkeypatch.setattr(finetune, "main", lambda: 3)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as exited:
            finetune.cli()
        assert exited.value.code == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_state_flags_put_the_moments_and_the_master_on_disk(tmp_path):
    from slidedp_lightning import StateOnDisk

    args = build_parser().parse_args(["--state-dir", str(tmp_path), "--optimizer-state", "int8", "--master-on-disk"])
    s = strategy_for(args)
    assert isinstance(s, SlideDPStrategy)
    assert s.options.optimizer_state == StateOnDisk(str(tmp_path), moments="int8", master=True)
    moments_only = strategy_for(build_parser().parse_args(["--state-dir", str(tmp_path)]))
    assert moments_only.options.optimizer_state == StateOnDisk(str(tmp_path))  # type: ignore[union-attr]
