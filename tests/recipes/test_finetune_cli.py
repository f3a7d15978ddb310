"""The fine-tune CLI's SlideDP route flags reach the strategy."""

import pytest

from slidedp_lightning import SlideDPStrategy
from slidedp_lightning.recipes.finetune import strategy_for
from slidedp_lightning_cli.finetune import build_parser


def test_route_flags_configure_the_strategy():
    args = build_parser().parse_args(
        ["--param-route", "sharded", "--grad-route", "host_reduce", "--chunk-bytes", "4096"]
    )
    s = strategy_for(args)
    assert isinstance(s, SlideDPStrategy)
    assert (s.options.param_route, s.options.grad_route, s.options.chunk_bytes) == ("sharded", "host_reduce", 4096)


def test_defaults_keep_the_registered_strategy(tmp_path):
    assert strategy_for(build_parser().parse_args(["--model", str(tmp_path)])) == "slidedp"
    assert strategy_for(build_parser().parse_args(["--strategy", "ddp"])) == "ddp"


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
