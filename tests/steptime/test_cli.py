"""python -m slidedp_lightning.steptime: predict table, profiles list, errors."""

from slidedp_lightning.steptime.__main__ import main


def test_predict_prints_the_breakdown(capsys):
    assert (
        main(
            [
                "predict",
                "--model",
                "qwen3-14b",
                "--hardware",
                "a800x8_bridge",
                "--batch",
                "8",
                "--seq",
                "1024",
                "--gpus",
                "8",
                "--param-route",
                "sharded",
                "--activation",
                "full",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for word in ("step time (s)", "tokens/s", "bottleneck", "exposed", "lower bound", "update", "h2d", "gpu-bound"):
        assert word in out


def test_profiles_lists_shipped(capsys):
    assert main(["profiles"]) == 0
    assert "h100x8" in capsys.readouterr().out


def test_errors_are_clear(capsys, tmp_path):
    assert (
        main(["predict", "--model", "qwen3-14b", "--hardware", "nope", "--batch", "1", "--seq", "8", "--gpus", "1"])
        == 2
    )
    assert "unknown hardware profile 'nope'" in capsys.readouterr().err
    assert (
        main(["predict", "--model", "qwen3-14b", "--hardware", "h200x1", "--batch", "1", "--seq", "8", "--gpus", "2"])
        == 2
    )
    assert "cannot model R=2" in capsys.readouterr().err
    assert (
        main(
            [
                "predict",
                "--model",
                str(tmp_path / "none.json"),
                "--hardware",
                "h200x1",
                "--batch",
                "1",
                "--seq",
                "8",
                "--gpus",
                "1",
            ]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
