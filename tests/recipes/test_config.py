"""slidedp-finetune --config: a YAML file of settings by flag name, checked as the flags are, overridden by the
command line; --print-config prints the resolved file, which reads back to the same run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slidedp_lightning.recipes.settings import NOT_SETTINGS
from slidedp_lightning_cli.finetune import main, parse

CLI = Path(sys.executable).with_name("slidedp-finetune")
FLAGS = ["--optimizer-state", "int8", "--no-bf16-copy", "--activation-policy", "full@0.5", "--chunk-bytes", "auto",
         "--max-steps", "7", "--lr", "0.002", "--gradient-clip-val", "1.5", "--lr-schedule", "linear",
         "--lora-r", "4", "--lora-targets", "q_proj,v_proj", "--export-adapter-only"]  # fmt: skip


def settings(args) -> dict:
    """The run's settings: every parsed value but what the command line says about itself (which file, print)."""
    return {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}


def test_the_printed_config_reads_back_to_the_same_settings(tmp_path, capsys):
    assert main([*FLAGS, "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "job.yaml").write_text(printed)
    from_file = parse(["--config", str(tmp_path / "job.yaml")])
    assert settings(from_file) == settings(parse(FLAGS))
    assert (from_file.optimizer_state, from_file.bf16_copy, from_file.chunk_bytes) == ("int8", False, "auto")
    assert (from_file.lora_r, from_file.lora_targets, from_file.export_adapter_only) == (4, "q_proj,v_proj", True)
    assert main(["--config", str(tmp_path / "job.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed


def test_the_command_line_overrides_the_file(tmp_path):
    (tmp_path / "job.yaml").write_text("max-steps: 10\noptimizer_state: int8\nbf16-copy: false\nlr: 3e-3\n")
    args = parse(["--config", str(tmp_path / "job.yaml"), "--max-steps", "3", "--bf16-copy"])
    assert (args.max_steps, args.optimizer_state, args.bf16_copy, args.lr) == (3, "int8", True, 0.003)
    args = parse(["--max-steps", "3", "--config", str(tmp_path / "job.yaml")])  # wherever --config stands
    assert args.max_steps == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("optimizer-state: int4\n", "--config {f}: argument --optimizer-state: invalid choice: 'int4'"),
        ("max-steps: ten\n", "--config {f}: argument --max-steps: invalid int value: 'ten'"),
        ("steps: 10\n", "--config {f}: 'steps' is not a setting"),
        ("bf16-copy: maybe\n", "--config {f}: bf16-copy must be true or false, got 'maybe'"),
        ("export-adapter-only: 1\n", "--config {f}: export-adapter-only must be true or false, got 1"),
        ("- max-steps\n", "--config {f}: holds a list, not settings by flag name"),
        ("max-steps: [1, 2]\n", "--config {f}: max-steps takes one value"),
        ("max-steps: {\n", "--config {f}: is not YAML"),
        ("config: other.yaml\n", "--config {f}: 'config' is not a setting"),
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path, capsys, text, message):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(f)])
    assert exit_.value.code == 2
    assert message.format(f=f) in capsys.readouterr().err


def test_a_missing_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "nope.yaml")])
    assert f"--config {tmp_path / 'nope.yaml'}: cannot be read" in capsys.readouterr().err


def test_print_config_answers_without_torch(tmp_path):
    code = (
        "import sys; from slidedp_lightning_cli.finetune import main; main(['--print-config']); "
        "print(sorted(m for m in ('torch', 'lightning', 'slidedp_lightning') if m in sys.modules), file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr.strip().endswith("[]"), proc.stderr
    assert "optimizer-state: fp32" in proc.stdout
