"""``slidedp-finetune``'s command line (:mod:`slidedp_lightning_cli.finetune`): every bad value refused in one line
(exit status 2) before anything heavy is imported or any process starts; ``--help`` fast, one default per flag, help
for every flag; ``import slidedp_lightning`` still registering the strategy; and the main job as one launch (one
banner, one ledger, one checkpoint read), quiet, its before/after table last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slidedp_lightning_cli.finetune import _HelpFormatter, build_parser

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("slidedp-finetune")

# Runs the installed console script (the file pip wrote) in this interpreter, then reports what it imported: the
# heavy libraries and the package ``slidedp_lightning`` (whose __init__ imports Lightning to register the strategy).
RUNNER = """
import runpy, sys, time
t0 = time.perf_counter()
sys.argv = sys.argv[1:]
code = 0
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "lightning", "transformers", "slidedp_lightning") if m in sys.modules)
print("RESULT", code, ",".join(heavy) or "-", f"{time.perf_counter() - t0:.3f}", file=sys.stderr)
"""
HEAVY = ("torch", "lightning", "transformers")


def _ckpt_without_config(tmp: Path) -> str:
    (tmp / "noconfig").mkdir(exist_ok=True)
    (tmp / "noconfig" / "model.safetensors").write_bytes(b"")
    return str(tmp / "noconfig")


def _gpt_oss(tmp: Path) -> str:
    (tmp / "gpt_oss").mkdir(exist_ok=True)
    (tmp / "gpt_oss" / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "vocab_size": 201088}))
    return str(tmp / "gpt_oss")


def _small_vocab(tmp: Path) -> str:
    (tmp / "small").mkdir(exist_ok=True)
    (tmp / "small" / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 16}))
    return str(tmp / "small")


BAD = {
    "batch-size 0": (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    "devices 0": (["--devices", "0"], "--devices must be >= 1, got 0"),
    "max-steps 0": (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    "negative lr": (["--lr", "-0.001"], "--lr must be a positive number, got -0.001"),
    "seq-len 0": (["--model", "{model}", "--data", "{data}", "--seq-len", "0"], "--seq-len must be >= 2, got 0"),
    "no config.json": (["--model", "{noconfig}"], "has no config.json"),
    "small vocabulary": (["--model", "{small}"], "has a vocabulary of 16 token ids"),
    "missing data": (["--model", "{model}", "--data", "{tmp}/nope.jsonl"], "--data {tmp}/nope.jsonl does not exist"),
    "data directory": (
        ["--model", "{model}", "--data", "{tmp}"],
        "is a directory: pass a JSONL (or .json, .parquet, .arrow) file",
    ),
    "val-data without data": (["--val-data", "{data}"], "--val-data goes with --data"),
    "data without model": (["--data", "{data}"], "--data needs --model DIR"),
    "unknown precision": (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    "16-mixed under ddp on cpu": (["--precision", "16-mixed", "--strategy", "ddp"], "Lightning runs bf16 there"),
    "not an int": (["--max-steps", "ten"], "argument --max-steps: invalid int value: 'ten'"),
    "warmup -1": (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    "chunk-bytes below the engine's": (["--chunk-bytes", "63"], "argument --chunk-bytes: must be >= 64 bytes, got 63"),
    "replicated with host_reduce": (
        ["--param-route", "replicated", "--grad-route", "host_reduce"],
        "reduces gradients with an all-reduce on the devices: use --grad-route gpu_reduce",
    ),
    "results a directory": (["--results", "{tmp}"], "--results {tmp} is a directory: pass a file path"),
    "unknown optimizer state": (["--optimizer-state", "int4"], "argument --optimizer-state: invalid choice: 'int4'"),
    "unknown activation mode": (
        ["--activation-policy", "most@0.5"],
        "--activation-policy most@0.5: 'most' is not a mode",
    ),
    "missing activation plan": (["--activation-policy", "{tmp}/plan.json"], "is not a file: pass an activation plan"),
    "accumulate 0": (["--accumulate-grad-batches", "0"], "--accumulate-grad-batches must be >= 1, got 0"),
    "clip 0": (["--gradient-clip-val", "0"], "--gradient-clip-val must be a positive number, got 0"),
    "clip nan": (["--gradient-clip-val", "nan"], "--gradient-clip-val must be a positive number, got nan"),
    "negative weight decay": (["--weight-decay", "-0.1"], "--weight-decay must be a number >= 0, got -0.1"),
    "val-every 0": (["--val-every", "0"], "--val-every must be >= 1, got 0"),
    "negative chunked loss": (["--chunked-loss", "-1"], "--chunked-loss must be >= 0, got -1"),
    "unknown schedule": (["--lr-schedule", "step"], "argument --lr-schedule: invalid choice: 'step'"),
    "lora flags without a rank": (
        ["--lora-alpha", "16", "--lora-targets", "q_proj"],
        "--lora-alpha, --lora-targets configure LoRA: add --lora-r N",
    ),
    "lora rank 0": (["--model", "{model}", "--lora-r", "0"], "--lora-r must be >= 1, got 0"),
    "lora dropout 1": (
        ["--model", "{model}", "--lora-r", "8", "--lora-dropout", "1"],
        "--lora-dropout must be in [0, 1), got 1",
    ),
    "lora on random init": (["--lora-r", "8"], "--lora-r adapts a pretrained model: add --model DIR"),
    "adapter-only without export": (
        ["--model", "{model}", "--lora-r", "8", "--export-adapter-only"],
        "add --export OUT",
    ),
    "val-split 0": (
        ["--model", "{model}", "--data", "{data}", "--val-split", "0"],
        "--val-split must be a fraction in (0, 1), got 0",
    ),
    "val-split and val-data": (
        ["--model", "{model}", "--data", "{data}", "--val-split", "0.1", "--val-data", "{data}"],
        "--val-split holds part of --data out for validation: drop it, or drop --val-data",
    ),
    "val-split without data": (["--val-split", "0.1"], "--val-split goes with --data"),
    "missing parquet data": (
        ["--model", "{model}", "--data", "{tmp}/nope.parquet"],
        "--data {tmp}/nope.parquet does not exist",
    ),
    "no-meta-init with a checkpoint": (
        ["--model", "{model}", "--no-meta-init"],
        "--no-meta-init applies to SlideDP's random-init model: a --model checkpoint",
    ),
    "no-meta-init under ddp": (["--strategy", "ddp", "--no-meta-init"], "use --strategy slidedp"),
    "pack without data": (["--pack"], "--pack goes with --data (your JSONL data), not the synthetic task"),
    "truncate without data": (["--truncate"], "--truncate goes with --data"),
    "pack a model that mixes packed examples": (
        ["--model", "{gpt_oss}", "--data", "{data}", "--pack"],
        "--pack: model type 'gpt_oss' is not one whose attention is known to keep packed examples apart",
    ),
    "max-steps and max-epochs": (
        ["--max-steps", "5", "--max-epochs", "1"],
        "--max-steps and --max-epochs both say when",
    ),
    "max-epochs 0": (["--max-epochs", "0"], "--max-epochs must be >= 1, got 0"),
    "checkpoint-every without a dir": (["--checkpoint-every", "5"], "add --checkpoint-dir DIR"),
    "resume auto without a dir": (["--resume", "auto"], "--resume auto looks under --checkpoint-dir"),
    "resume a missing checkpoint": (["--resume", "{tmp}/nope.ckpt"], "--resume {tmp}/nope.ckpt does not exist"),
    "keep-last 0": (["--checkpoint-dir", "{tmp}/ck", "--keep-last", "0"], "--keep-last must be >= 1, got 0"),
    "checkpoint dir a file": (["--checkpoint-dir", "{data}"], "exists and is not a directory"),
    "slidedp knobs under ddp": (
        ["--strategy", "ddp", "--optimizer-state", "int8", "--no-bf16-copy"],
        "--optimizer-state, --no-bf16-copy configure SlideDP: use them with --strategy slidedp",
    ),
    "master on disk without a state dir": (["--master-on-disk"], "keeps the master in the state file of --state-dir"),
    "master on disk under 32-true": (
        ["--state-dir", "{tmp}", "--master-on-disk", "--precision", "32-true"],
        "it needs --precision bf16-mixed and the BF16 copy (got --precision 32-true)",
    ),
    "master on disk without the copy": (
        ["--state-dir", "{tmp}", "--master-on-disk", "--precision", "bf16-mixed", "--no-bf16-copy"],
        "(got --precision bf16-mixed, --no-bf16-copy)",
    ),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    (tmp / "data.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    return {
        "tmp": str(tmp),
        "model": str(tmp / "model"),
        "data": str(tmp / "data.jsonl"),
        "noconfig": _ckpt_without_config(tmp),
        "small": _small_vocab(tmp),
        "gpt_oss": _gpt_oss(tmp),
    }


def _run_cli(tmp: str, argv: list[str]) -> tuple[int, str, float, str]:
    """The console script run with ``argv``: (exit status, stderr without the result line, seconds of the whole
    subprocess, the heavy modules it imported, comma-separated, or "-")."""
    runner = Path(tmp) / "run_cli.py"
    runner.write_text(RUNNER)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(runner), str(CLI), *argv], capture_output=True, text=True, timeout=120, cwd=tmp
    )
    seconds = time.perf_counter() - t0
    lines = proc.stderr.strip().splitlines()
    result = lines.pop().split()
    assert result[0] == "RESULT", proc.stderr
    return int(result[1]), "\n".join(lines), seconds, result[2]


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_value_is_refused_in_one_line_with_status_2(paths, case, record_property):
    argv, expected = BAD[case]
    argv = [a.format(**paths) for a in argv]
    code, err, seconds, heavy = _run_cli(paths["tmp"], argv)
    record_property("seconds", round(seconds, 3))
    assert code == 2, (case, err)
    assert len(err.splitlines()) == 1 and err.startswith("slidedp-finetune: error: "), err
    assert expected.format(**paths) in err, err
    assert heavy == "-", f"{case}: the CLI imported {heavy} before refusing"
    assert seconds < 3.0, f"{case}: refused after {seconds:.2f} s"


def test_the_real_command_refuses_in_one_line(paths, record_property):
    """Through the installed console script (which imports the package first): the same one line, status 2."""
    t0 = time.perf_counter()
    proc = subprocess.run([str(CLI), "--batch-size", "0"], capture_output=True, text=True, timeout=120)
    record_property("seconds", round(time.perf_counter() - t0, 3))
    assert proc.returncode == 2 and proc.stdout == ""
    ours = [line for line in proc.stderr.splitlines() if "slidedp-finetune" in line]
    assert ours == [proc.stderr.strip().splitlines()[-1]], proc.stderr
    assert "--batch-size must be >= 1, got 0" in ours[0]


def test_help_is_fast(paths, record_property):
    """``slidedp-finetune --help`` imports neither torch, Lightning, transformers nor ``slidedp_lightning`` and
    answers in under 2 s: the best of three runs of the installed command (the best, so that a loaded machine's
    pauses do not decide; the import check above holds whatever the load)."""
    code, out, _, heavy = _run_cli(paths["tmp"], ["--help"])
    assert code == 0 and heavy == "-", f"--help imported {heavy}"
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        proc = subprocess.run([str(CLI), "--help"], capture_output=True, text=True, timeout=120, cwd=paths["tmp"])
        times.append(time.perf_counter() - t0)
        assert proc.returncode == 0 and "--precision" in proc.stdout, proc.stderr
    record_property("help_s", round(min(times), 3))
    print("--help: " + ", ".join(f"{t:.2f} s" for t in times))
    assert min(times) < 2.0, times


EARLY_RUNNER = """
import sys
from slidedp_lightning_cli import finetune
def begin(local_ranks):
    heavy = sorted(m for m in ("torch", "lightning", "transformers", "slidedp_lightning") if m in sys.modules)
    print("BEGIN", local_ranks, ",".join(heavy) or "-", flush=True)
    raise SystemExit(0)
finetune.early_ranks.begin = begin
finetune.main(sys.argv[1:])
"""


def test_the_job_starts_its_other_ranks_once_the_flags_are_checked_before_any_heavy_import(tmp_path):
    """The command hands ``--devices`` to :func:`slidedp_lightning.process.early_ranks.begin` (which starts the other
    ranks, tested in tests/process/test_early_ranks.py) before it imports torch, Lightning or the library; a refused
    flag starts nothing."""
    runner = tmp_path / "early.py"
    runner.write_text(EARLY_RUNNER)
    argv = [sys.executable, str(runner), "--devices", "3", "--max-steps", "2", "--results", str(tmp_path / "r.json")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "BEGIN 3 -", (proc.stdout, proc.stderr)
    refused = subprocess.run([*argv, "--lr", "-1"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert refused.returncode == 2 and "BEGIN" not in refused.stdout, (refused.stdout, refused.stderr)


@pytest.mark.slow  # a subprocess of its own: out of the fast tier
def test_the_package_import_still_registers_the_strategy(tmp_path):
    """The console script avoids ``import slidedp_lightning``; that import itself still registers
    ``strategy="slidedp"`` with the Trainer and Fabric, before the user imports Lightning (a fresh interpreter)."""
    script = (
        "import slidedp_lightning\n"
        "import lightning as L\n"
        "trainer = L.Trainer(strategy='slidedp', accelerator='cpu', devices=1, logger=False)\n"
        "assert isinstance(trainer.strategy, slidedp_lightning.SlideDPStrategy), type(trainer.strategy)\n"
        "fabric = L.Fabric(strategy='slidedp', accelerator='cpu', devices=1)\n"
        "assert isinstance(fabric.strategy, slidedp_lightning.SlideDPFabricStrategy), type(fabric.strategy)\n"
        "print('registered')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("registered"), proc.stderr[-3000:]


def test_the_command_line_modules_import_nothing_heavy(tmp_path):
    """Importing every module of ``slidedp_lightning_cli`` loads neither the library nor torch, Lightning or
    transformers (a fresh interpreter)."""
    modules = sorted(p.stem for p in (ROOT / "slidedp_lightning_cli").glob("*.py") if p.stem != "__init__")
    assert {"finetune", "task"} <= set(modules)
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('slidedp_lightning_cli.' + name)\n"
        f"print(sorted(m for m in {(*HEAVY, 'slidedp_lightning')!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_a_dry_run_with_a_hardware_profile_imports_nothing_heavy(tmp_path):
    """``--dry-run --hardware`` runs the step-time simulator as plain Python (a fresh interpreter): the prediction
    line, and neither the library's package nor torch, Lightning or transformers loaded."""
    model = tmp_path / "m"
    model.mkdir()
    config = ROOT / "slidedp_lightning" / "recipes" / "configs" / "qwen3_tiny.json"
    (model / "config.json").write_text(config.read_text())
    script = (
        "import sys\n"
        "from slidedp_lightning_cli.finetune import main\n"
        f"assert main(['--model', {str(model)!r}, '--devices', '1', '--dry-run', '--hardware', 'h200x1']) == 0\n"
        f"print(sorted(m for m in {(*HEAVY, 'slidedp_lightning', 'slidedp_lightning.steptime')!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    *report, loaded = proc.stdout.strip().splitlines()
    assert report[-1].startswith("  predicted on h200x1 (1 GPU, batch "), proc.stdout
    assert loaded == "[]", proc.stdout


def test_the_command_line_refuses_what_the_strategy_refuses():
    """The values the CLI lets through are the strategy's: the smallest gradient chunk, the routes that combine."""
    from slidedp_lightning import SlideDPStrategy
    from slidedp_lightning.recipes.settings import MIN_CHUNK_BYTES

    SlideDPStrategy(chunk_bytes=MIN_CHUNK_BYTES)
    with pytest.raises(ValueError, match="chunk_bytes"):
        SlideDPStrategy(chunk_bytes=MIN_CHUNK_BYTES - 1)
    with pytest.raises(ValueError, match="grad_route"):
        SlideDPStrategy(param_route="replicated", grad_route="host_reduce")


def test_every_flag_has_help_and_one_default():
    parser = build_parser()
    formatter = _HelpFormatter(parser.prog)
    for action in parser._actions:
        if action.dest == "help":
            continue
        text = formatter._get_help_string(action)
        assert action.help, f"{action.option_strings} has no help"
        assert text.count("default:") == 1 and text.endswith(")"), text
    assert "(default: None)" not in parser.format_help()


# -- the main job: one launch -----------------------------------------------------------------------------------
def _tiny_checkpoint(out: Path) -> str:
    from transformers import AutoModelForCausalLM

    from slidedp_lightning.recipes.module import load_tiny_config

    config, attn = load_tiny_config()
    AutoModelForCausalLM.from_config(config, attn_implementation=attn).save_pretrained(out)
    return str(out)


ENVIRONMENT_NOISE = re.compile(r"^Skipping import of cpp extensions")  # torchao built for another torch


@pytest.mark.slow
@pytest.mark.parametrize("source", ["random-init", "checkpoint"])
def test_the_main_job_is_one_quiet_launch(tmp_path, source):
    """One fit: one "Initializing distributed" banner, the ledger built once (one ledger file, one "SlideDP rank 0/2"
    summary) and, with --model, the checkpoint read once ("SlideDP read checkpoint ... into the ledger"); no advice
    that the job triggers itself, no model summary, no progress-bar fields (not a terminal: no bar at all), at most
    22 lines (the plan first, in one line), the table last with the host-memory line; the "after" metrics are the
    last step's evaluation that TensorBoard logged."""
    args = ["--max-steps", "6", "--results", str(tmp_path / "r.json"), "--log-dir", str(tmp_path / "logs")]
    if source == "checkpoint":
        args += ["--model", _tiny_checkpoint(tmp_path / "ckpt")]
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(CLI), *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    seconds = time.perf_counter() - t0
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    lines = [line for line in out.splitlines() if not ENVIRONMENT_NOISE.match(line)]
    print(f"{source}: {len(lines)} lines in {seconds:.1f} s\n" + "\n".join(lines))

    def count(pattern: str) -> int:
        return sum(1 for line in lines if re.search(pattern, line))

    assert count(r"^Initializing distributed: ") == 1, out
    assert count(r"^SlideDP ledger file: ") == 1, out
    assert count(r"^SlideDP rank 0/2: \d+ units") == 1, out
    if source == "checkpoint":
        assert count(r"^SlideDP read checkpoint .* into the ledger") == 1, out
        assert count(r"^SlideDP initialized") == 0, out
    else:
        assert count(r"^SlideDP initialized [\d,]+ params unit by unit into the ledger") == 1, out
    for noise in ("materialized on every rank", "model summary", "v_num", "Epoch 0/", "FLOPs", "Tip:", "Sanity"):
        assert noise not in out, noise
    # on a CPU without fast bf16 (AVX2 only) the job says in one more line why it trains in 32-true
    precision_note = count(r"^--precision 32-true by default: this CPU \(")
    assert precision_note <= 1 and len(lines) <= 22 + precision_note, "\n".join(lines)
    assert count(r"^plan: [\d.]+ M parameters, ledger .*: fits \(--dry-run: the whole plan\)$") == 1, out
    assert lines[-1].startswith("TensorBoard logs: ") and lines[-2].startswith("peak host memory "), lines[-7:]
    assert lines[-5].startswith("before ") and lines[-4].startswith("after "), lines[-7:]

    results = json.loads((tmp_path / "r.json").read_text())
    assert results["steps"] == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (version,) = (tmp_path / "logs").iterdir()
    events = EventAccumulator(str(version))
    events.Reload()
    last = events.Scalars("val_loss")[-1]
    assert last.step >= 5 and abs(last.value - results["after"]["val_loss"]) < 1e-4, (last, results)
    assert results["before"]["val_loss"] > results["after"]["val_loss"]
    assert os.path.isdir(tmp_path / "logs")


def test_a_hub_id_in_the_local_cache_is_its_snapshot_directory(tmp_path, monkeypatch):
    """--model Qwen/Qwen3-0.6B: the model's directory in the local Hugging Face cache, found offline; a model that
    is not there is refused naming the cache and how to fill it; a directory is left as it is."""
    from huggingface_hub import constants

    from slidedp_lightning_cli.finetune import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    args = build_parser().parse_args(["--model", "org/tiny"])
    assert resolve_model(args) is None
    assert Path(args.model) == repo / "snapshots" / commit

    args = build_parser().parse_args(["--model", "org/absent"])
    problem = resolve_model(args)
    assert problem is not None and args.model == "org/absent"
    assert "--model org/absent is not a directory and not in the local Hugging Face cache" in problem
    assert str(tmp_path / "hub") in problem and "huggingface-cli download org/absent" in problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    args = build_parser().parse_args(["--model", "org/local"])
    assert resolve_model(args) is None and args.model == "org/local"
