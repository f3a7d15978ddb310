"""``slidedp-finetune``: fine-tune a causal LM on a synthetic task with PyTorch Lightning (the command line).

The job is one ``Trainer.fit`` (one launch of the rank processes, one ledger, one checkpoint read): it evaluates the
model over the whole validation set before the first step (Lightning's sanity check, its metrics kept), trains, and
evaluates again at the last step, then prints the task's loss and answer-token accuracy before and after.  By default
it random-initializes a tiny Qwen3 from ``slidedp_lightning/recipes/configs/qwen3_tiny.json`` (on the meta device,
each unit initialized straight into the ledger) and trains it with ``strategy="slidedp"`` on 2 CPU processes;
``--model DIR`` fine-tunes a local Hugging Face checkpoint instead, and ``--strategy ddp`` runs the same job with
Lightning's DDP for comparison.

This module imports neither torch nor Lightning nor transformers, nor the package :mod:`slidedp_lightning` (whose
``__init__`` imports Lightning to register the strategy): every flag is parsed and checked (a bad one refused in one
line, exit status 2) before :mod:`slidedp_lightning.recipes.job` is imported and any process starts.  Two checks
need the library and import it when they run: an ``--export`` target (what a model directory holds) and a
``--model`` whose ``config.json`` states no vocabulary size.

Multi-process strategies on CPU re-run this script (``sys.argv``) once per extra rank, so call :func:`main` from a
script or the ``slidedp-finetune`` console command rather than with a hand-made ``argv`` when ``--devices > 1``.

Run ``slidedp-finetune --help`` for the flags.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from slidedp_lightning_cli.task import early_ranks, load_simulator, plan, settings

__all__ = [
    "build_parser",
    "check_args",
    "check_outputs",
    "cli",
    "config_vocab_size",
    "main",
]


# ---------------------------------------------------------------------- CLI
class _Parser(argparse.ArgumentParser):
    """argparse's conventions (exit status 2 for a bad command line), in one line: no usage block before it.
    ``source``: the ``--config`` file being read, named in the message."""

    source: str | None = None

    def error(self, message: str) -> NoReturn:
        where = f"--config {self.source}: " if self.source else ""
        self.exit(2, f"{self.prog}: error: {where}{message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """One default per flag: ``(default: X)`` appended from the flag's value unless the help text states its own
    (a flag without a value, ``None``, states what happens without it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)"


def _state_dir(value: str) -> str:
    """--state-dir: an existing directory (on a local disk), as an absolute path."""
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an existing directory (create it on a local disk)")
    return os.path.abspath(value)


def _chunk_bytes(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'expected a positive integer or "auto", got {text!r}') from None
    if value < settings.MIN_CHUNK_BYTES:
        raise argparse.ArgumentTypeError(f"must be >= {settings.MIN_CHUNK_BYTES} bytes, got {value}")
    return value


def build_parser() -> _Parser:
    """``slidedp-finetune``'s flags: one help line each, its default stated once (see :class:`_HelpFormatter`)."""
    p = _Parser(
        prog="slidedp-finetune",
        description=(
            f"Train a causal LM on a synthetic task ({settings.TASK.task} {settings.TASK.length} of {settings.TASK.num_symbols} symbols) "
            "or on your JSONL data, and report loss/accuracy before and after."
        ),
        formatter_class=_HelpFormatter,
    )
    add = p.add_argument
    add(
        "--model",
        metavar="DIR|ID",
        help="Hugging Face checkpoint to fine-tune: a directory (config.json + safetensors) or a hub id in the "
        "local Hugging Face cache, e.g. Qwen/Qwen3-0.6B (offline) "
        f"(default: a random-init tiny Qwen3, configs/{settings.DEFAULT_CONFIG})",
    )
    add(
        "--data",
        metavar="FILE",
        help="training data, one {prompt, completion} or {messages: [{role, content}, ...]} object a line of a JSONL "
        "file, or a row of a local .json, .parquet or .arrow file or save_to_disk directory (Hugging Face datasets, "
        "offline); needs --model (its tokenizer and chat template); loss on completion / assistant tokens only "
        "(default: the synthetic task)",
    )
    add("--val-data", metavar="FILE", help="--data only: validation data, as --data (default: --data)")
    add(
        "--val-split",
        type=float,
        metavar="F",
        help="--data only: hold a seeded random fraction F of --data out of training to validate on "
        "(default: validate on --data itself)",
    )
    add(
        "--seq-len",
        type=int,
        metavar="N",
        default=settings.DEFAULT_SEQ_LEN,
        help="--data only: tokens per row, each example its own right-padded row unless --pack; a longer example is "
        "refused with its file and line unless --truncate",
    )
    add(
        "--pack",
        action="store_true",
        help="--data only: concatenate training examples into full --seq-len rows, each attending only to itself "
        "(position ids restart per example); validation keeps one example a row (default: one example a row)",
    )
    add(
        "--truncate",
        action="store_true",
        help="--data only: cut an example longer than --seq-len to its first --seq-len tokens, and leave out one "
        "with no loss token left (both counted in the log) (default: refuse it)",
    )
    add(
        "--export",
        metavar="OUT",
        help="--data only: write the trained model and the tokenizer to OUT, a save_pretrained directory "
        "(default: no export)",
    )
    add(
        "--export-dtype",
        choices=settings.EXPORT_DTYPES,
        help="dtype of --export (default: float32 with --precision 32-true, else bfloat16)",
    )
    add("--results", metavar="FILE", help="write the before/after metrics as JSON to FILE (default: not written)")
    add("--devices", type=int, metavar="N", default=2, help="number of processes (ranks), one device each")
    add("--accelerator", default="cpu", choices=settings.ACCELERATORS, help="Lightning accelerator")
    add(
        "--precision",
        choices=settings.PRECISIONS,
        help="bf16-mixed: BF16 compute on an FP32 master; 16-mixed: FP16 autocast with dynamic loss scaling "
        "(--strategy slidedp on CPU, any strategy on CUDA); 32-true: FP32 throughout (default: bf16-mixed; 32-true "
        "on --accelerator cpu when the CPU has neither AVX512-BF16 nor AMX, where bf16 matmuls are emulated)",
    )
    add(
        "--strategy",
        default="slidedp",
        choices=settings.STRATEGIES,
        help="slidedp: weights in a host ledger, layers streamed to the devices; ddp: Lightning's DDP, for comparison",
    )
    add(
        "--trace-dir",
        metavar="DIR",
        help="slidedp only: record the lanes (TensorBoard scalars, Gantt figure, Chrome trace) under DIR "
        "(default: no trace)",
    )
    add(
        "--param-route",
        default="full",
        choices=settings.PARAM_ROUTES,
        help="slidedp only: how parameters reach the devices",
    )
    add(
        "--grad-route",
        default="gpu_reduce",
        choices=settings.GRAD_ROUTES,
        help="slidedp only: how gradients are reduced and returned to the host",
    )
    add(
        "--chunk-bytes",
        type=_chunk_bytes,
        metavar="N|auto",
        help='slidedp only: gradient chunk size in bytes, or "auto" to measure it at setup (default: whole units)',
    )
    add(
        "--optimizer-state",
        default="fp32",
        choices=settings.OPTIMIZER_STATES,
        help="slidedp only: the Adam moments in the host ledger, exact (fp32) or block-wise 8-bit (int8: "
        "6 B/param less)",
    )
    add(
        "--state-dir",
        metavar="DIR",
        type=_state_dir,
        help="slidedp only: keep the Adam moments in a file on a local disk in DIR (an NVMe SSD for speed) instead of "
        "host memory: 8 B/param less with fp32 moments, 2 with int8; the file is unnamed, gone when the job ends "
        "(default: in host memory)",
    )
    add(
        "--master-on-disk",
        action="store_true",
        help="slidedp only, with --state-dir and --precision bf16-mixed: the FP32 master weights in the state file "
        "too, 4 B/param less host memory; the BF16 copy the devices read stays, 2 B/param (default: in memory)",
    )
    add(
        "--bf16-copy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="slidedp only: keep the BF16 transfer copy of the weights in the ledger; --no-bf16-copy converts it "
        "from the FP32 master on the way, 2 B/param less (default: kept)",
    )
    add(
        "--activation-policy",
        metavar="POLICY",
        help="slidedp only: how each decoder block keeps its activations for backward: none, full, selective or "
        "segments:MASK (each with an optional @RATIO offloaded to the host), auto (AutoPolicy) or a plan .json "
        f"(default: {settings.MODEL_ACTIVATION_POLICY} with --model, else none)",
    )
    add(
        "--chunked-loss",
        type=int,
        metavar="N",
        help="compute the loss N tokens at a time, never the whole [batch, seq, vocab] logits; 0: the model's own "
        f"loss (default: {settings.MODEL_CHUNKED_LOSS} with --model, else 0)",
    )
    add(
        "--meta-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="slidedp only, the random-init model: build it on the meta device, each unit initialized straight into "
        "the ledger (no rank holds the whole model); --no-meta-init builds it whole in each rank first (a --model "
        "checkpoint is always read straight into the ledger) (default: on)",
    )
    add(
        "--update-threads",
        type=int,
        metavar="N",
        help="slidedp only: CPU threads per rank for the Adam update (default: physical cores / ranks)",
    )
    add(
        "--lora-r",
        type=int,
        metavar="N",
        help="train LoRA adapters of rank N on the --model checkpoint instead of every weight (peft; --export "
        "writes the merged model) (default: full fine-tuning)",
    )
    add("--lora-alpha", type=float, metavar="A", help="LoRA's scaling numerator (default: twice --lora-r)")
    add(
        "--lora-dropout",
        type=float,
        metavar="P",
        default=0.0,
        help="dropout on the LoRA branch's input (default: 0, none)",
    )
    add(
        "--lora-targets",
        metavar="NAMES",
        help="comma-separated module names to adapt, e.g. q_proj,v_proj (default: every linear layer but the head)",
    )
    add(
        "--export-adapter-only",
        action="store_true",
        help="with --lora-r: --export writes the adapters alone, in peft's format (default: the merged model)",
    )
    add(
        "--max-steps",
        type=int,
        metavar="N",
        help=f"optimizer steps (default: {settings.DEFAULT_MAX_STEPS}, or what --max-epochs makes)",
    )
    add(
        "--max-epochs",
        type=int,
        metavar="N",
        help="passes over the training data instead of --max-steps (default: none)",
    )
    add("--batch-size", type=int, metavar="N", default=settings.DEFAULT_BATCH_SIZE, help="examples per device per step")
    add(
        "--lr",
        type=float,
        help=f"peak AdamW learning rate (default: {settings.DEFAULT_LR:g}; {settings.DEFAULT_DATA_LR:g} with --data)",
    )
    add("--warmup-steps", type=int, metavar="N", help="linear warm-up steps (default: 10%% of --max-steps)")
    add(
        "--lr-schedule",
        default=settings.DEFAULT_LR_SCHEDULE,
        choices=settings.LR_SCHEDULES,
        help="the learning rate after the warm-up: cosine or linear decay to 0 at the last step, or constant",
    )
    add(
        "--weight-decay",
        type=float,
        metavar="X",
        default=settings.DEFAULT_WEIGHT_DECAY,
        help="AdamW's decoupled weight decay (not applied to norms and biases)",
    )
    add(
        "--accumulate-grad-batches",
        type=int,
        metavar="N",
        default=1,
        help="backward passes (batches) per optimizer step",
    )
    add(
        "--gradient-clip-val",
        type=float,
        metavar="X",
        help="clip the gradients' global L2 norm to X before each step (default: no clipping)",
    )
    add(
        "--val-every",
        type=int,
        metavar="N",
        help="evaluate every N optimizer steps, and at the last (default: a quarter of --max-steps)",
    )
    add(
        "--seed",
        type=int,
        metavar="N",
        default=settings.DEFAULT_SEED,
        help="seed of the data order, the weights and dropout",
    )
    add(
        "--checkpoint-dir",
        metavar="DIR",
        help="write the strategy's checkpoints (weights, Adam moments, schedule, step, data position) under DIR, "
        "one directory each, atomically (default: none)",
    )
    add(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help="a checkpoint every N optimizer steps, and at the last (default: one, at --max-steps)",
    )
    add("--keep-last", type=int, metavar="K", default=2, help="checkpoints kept under --checkpoint-dir, the newest")
    add(
        "--resume",
        metavar="CKPT|auto",
        help="continue a run from a checkpoint it wrote, bit for bit; auto: the newest complete one under "
        "--checkpoint-dir, or a fresh start when there is none (default: a fresh start)",
    )
    add("--log-dir", metavar="DIR", default=os.path.join("runs", "finetune"), help="TensorBoard log directory")
    add(
        "--config",
        metavar="FILE",
        help="a YAML (or JSON) file of settings by flag name (optimizer-state: int8); flags on the command line "
        "override it; every run writes its resolved file beside its TensorBoard logs (default: none)",
    )
    add(
        "--dry-run",
        action="store_true",
        help="print the job's plan (parameters, the host ledger by optimizer state, the host memory it needs and "
        "this host's, whether it fits and which flag would make it fit) from --model's files alone, and exit: "
        "status 0 when it fits, 1 when not (default: the plan is the run's first lines)",
    )
    add(
        "--hardware",
        metavar="PROFILE",
        help="--dry-run only: also predict the step time, tokens/s and what bounds the step on PROFILE, a profile "
        "of the step-time model (h200x1, h100x8, rtx4090x4, ...) or a file its calibrate command wrote (imports "
        "torch) (default: no prediction)",
    )
    add(
        "--print-config",
        action="store_true",
        help="print the resolved settings as such a file and exit (default: run the job)",
    )
    return p


def config_tokens(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags that the ``--config`` file at ``path`` sets, as command-line tokens, so that argparse checks
    them as it checks typed ones. Raises ``ValueError`` naming what is wrong."""
    import yaml  # plain Python, like the rest of the command line

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ValueError(f"cannot be read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"is not YAML: {' '.join(str(err).split())}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"holds a {type(data).__name__}, not settings by flag name (optimizer-state: int8)")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in settings.NOT_SETTINGS}
    tokens: list[str] = []
    for key, value in data.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None or action.dest == "help":
            raise ValueError(f"{key!r} is not a setting")
        flag = action.option_strings[0]
        if value is None:
            continue  # the flag's default
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
            tokens.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # a switch (store_true): given when the file turns it on
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
            if value != action.default:
                tokens.append(flag)
        elif isinstance(value, (dict, list)):
            raise ValueError(f"{key} takes one value, got {value!r}")
        else:
            tokens += [flag, str(value)]
    return tokens


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv`` (default: ``sys.argv``) over those of its ``--config`` file; a bad one ends the
    process in one line (exit status 2) naming the file when it is the file's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    tokens: list[str] = []
    if known.config:
        from_file = build_parser()
        from_file.source = known.config
        try:
            tokens = config_tokens(known.config, from_file)
        except ValueError as err:
            from_file.error(str(err))
        from_file.parse_args(tokens)  # the file's own values, checked alone: its errors name the file
    args = parser.parse_args([*tokens, *argv])
    args.precision_chosen = args.precision is not None
    if args.precision is None:  # the precision this host computes fast (--print-config writes it out)
        args.precision = settings.default_precision(args.accelerator)
    return args


def config_vocab_size(model_dir: str) -> int | None:
    """The vocabulary size that ``model_dir/config.json`` states (top level or ``text_config``), or None when it
    states none (then transformers' ``AutoConfig`` knows where it is)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError("config.json does not hold a JSON object")
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and isinstance(where.get("vocab_size"), int):
            return int(where["vocab_size"])
    return None


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def resolve_model(args: argparse.Namespace) -> str | None:
    """Turn a ``--model`` that names a Hugging Face hub model (``Qwen/Qwen3-0.6B``) rather than a directory into
    that model's directory in the local Hugging Face cache, offline; returns why it cannot (one line), or None."""
    model = args.model
    if model is None or os.path.exists(model) or not _HUB_ID.match(model) or model.startswith("."):
        return None
    from huggingface_hub import constants, snapshot_download  # plain Python, no torch
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        args.model = snapshot_download(model, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return (
            f"--model {model} is not a directory and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}): download it where there is a network (huggingface-cli download {model}) "
            "or pass a checkpoint directory"
        )
    return None


def _model_problem(model_dir: str, synthetic: bool, pack: bool = False) -> str | None:
    """Why ``--model model_dir`` cannot be fine-tuned (one line), or None."""
    if not os.path.isdir(model_dir):
        what = "is not a directory" if os.path.exists(model_dir) else "does not exist"
        return f"--model {model_dir} {what}: pass a local Hugging Face checkpoint directory (save_pretrained)"
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return (
            f"--model {model_dir} has no config.json: not a Hugging Face checkpoint directory "
            "(save_pretrained writes config.json and the safetensors files)"
        )
    try:
        if pack:
            with open(os.path.join(model_dir, "config.json")) as f:
                config = json.load(f)
            problem = settings.pack_problem(config.get("model_type") if isinstance(config, dict) else None)
            if problem is not None:
                return problem
        vocab = config_vocab_size(model_dir)
        if vocab is None and synthetic:
            from slidedp_lightning.recipes.module import checkpoint_vocab_size

            vocab = checkpoint_vocab_size(model_dir)
        if vocab is not None and synthetic:
            settings.check_vocab(vocab, settings.TASK, model_dir)
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        return f"--model {model_dir}: {' '.join(str(err).split())}"
    return None


def _input_file_problem(flag: str, path: str) -> str | None:
    if settings.needs_datasets(path):
        if not os.path.exists(path):
            return f"{flag} {path} does not exist"
        if importlib.util.find_spec("datasets") is None:
            return f"{flag} {path} is read with Hugging Face datasets, which is not installed: pip install datasets"
        return None
    if os.path.isdir(path):
        return (
            f"{flag} {path} is a directory: pass a JSONL (or .json, .parquet, .arrow) file, or a directory that "
            "datasets' save_to_disk wrote"
        )
    if not os.path.isfile(path):
        return f"{flag} {path} does not exist"
    if not os.access(path, os.R_OK):
        return f"{flag} {path} cannot be read (permissions)"
    return None


def _writable_file(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written as a file (one line), or None."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory: pass a file path"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path} cannot be written (permissions)"
    return None


def _writable_dir(flag: str, path: str) -> str | None:
    """Why a directory cannot be created or written at ``path`` (one line), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} exists and is not a directory: choose a directory path"
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        return f"{flag} {path} cannot be created or written: {probe} is not a writable directory"
    return None


def _checkpoint_problem(args: argparse.Namespace) -> str | None:
    """Why the checkpoint flags cannot make a run (one line), or None."""
    if args.checkpoint_dir is None:
        if args.checkpoint_every is not None:
            return "--checkpoint-every says how often to write to --checkpoint-dir: add --checkpoint-dir DIR"
        if args.resume == "auto":
            return "--resume auto looks under --checkpoint-dir: add --checkpoint-dir DIR (or --resume CKPT)"
    else:
        problem = _writable_dir("--checkpoint-dir", args.checkpoint_dir)
        if problem is not None:
            return problem
    if args.resume not in (None, "auto") and not os.path.isdir(args.resume) and not os.path.isfile(args.resume):
        return f"--resume {args.resume} does not exist: pass a checkpoint the run wrote, or auto"
    resume = settings.latest_checkpoint(args.checkpoint_dir) if args.resume == "auto" else args.resume
    return settings.resume_problem(args, resume) if resume else None


def _lora_problem(args: argparse.Namespace) -> str | None:
    """Why the LoRA flags cannot make a run (one line), or None."""
    if args.lora_r is None:
        given = [
            flag
            for flag, value in (
                ("--lora-alpha", args.lora_alpha is not None),
                ("--lora-dropout", args.lora_dropout != 0.0),
                ("--lora-targets", args.lora_targets is not None),
                ("--export-adapter-only", args.export_adapter_only),
            )
            if value
        ]
        return f"{', '.join(given)} configure LoRA: add --lora-r N" if given else None
    if args.lora_r < 1:
        return f"--lora-r must be >= 1, got {args.lora_r}"
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        return f"--lora-alpha must be a positive number, got {args.lora_alpha:g}"
    if not (0.0 <= args.lora_dropout < 1.0):
        return f"--lora-dropout must be in [0, 1), got {args.lora_dropout:g}"
    if args.lora_targets is not None and not [t for t in args.lora_targets.split(",") if t.strip()]:
        return "--lora-targets names no module: pass e.g. q_proj,v_proj"
    if args.model is None:
        return "--lora-r adapts a pretrained model: add --model DIR"
    if args.export_adapter_only and not args.export:
        return "--export-adapter-only says what --export writes: add --export OUT"
    if importlib.util.find_spec("peft") is None:
        return "--lora-r needs peft, which is not installed: pip install -e '.[peft]'"
    return None


def _activation_policy_problem(policy: str | None) -> str | None:
    """Why ``--activation-policy policy`` names no policy (one line), or None; the strategy checks the rest (a
    segment mask, an offload ratio) before any process starts."""
    if policy is None:
        return None
    if policy.endswith(".json"):
        if not os.path.isfile(policy):
            return f"--activation-policy {policy} is not a file: pass an activation plan .json (AutoPolicy writes one)"
        return None
    mode = policy.partition("@")[0].partition(":")[0]
    if mode not in settings.ACTIVATION_MODES:
        return (
            f"--activation-policy {policy}: {mode!r} is not a mode; use one of {', '.join(settings.ACTIVATION_MODES)} "
            "(segments:MASK, and an optional @RATIO offloaded to the host, e.g. full@0.5) or a plan .json"
        )
    return None


def _fit_problem(args: argparse.Namespace) -> str | None:
    """Why the job's ledger cannot fit in this host's memory (one line naming the flag that would make it fit),
    or None; a ledger that fits with less room than the ranks' estimated rest is left to run (the plan says so)."""
    if args.strategy != "slidedp":
        return None
    try:
        job = plan.of_flags(args)
    except (OSError, ValueError) as err:  # a config the plan cannot read: the run's own checks say more
        return None if args.model else f"the job's plan: {err}"
    if job.verdict != "does not fit":
        return None
    fix = job.fix()
    return (
        f"the job's ledger needs {plan.gib(job.ledger_bytes)} of host memory, and this host has "
        f"{plan.gib(min(job.host.mem_available, job.host.shared_free))} free (MemAvailable "
        f"{plan.gib(job.host.mem_available)}, {job.host.shared_dir} {plan.gib(job.host.shared_free)}): "
        + (f"add {fix}, which fits" if fix else "no flag of this command makes it fit; use a host with more memory")
        + " (--dry-run shows the plan)"
    )


def check_outputs(args: argparse.Namespace) -> str | None:
    """Why one of the run's output paths cannot be written (one line naming the flag, the cause and the fix), or
    None: checked before training, so that a run's weights are never trained and then lost."""
    if args.export:
        from slidedp_lightning.hf.export import check_export_target  # the library: what a model directory holds

        try:
            check_export_target(args.export)
        except OSError as err:
            return f"--export {args.export}: {err}"
        if args.results and os.path.abspath(args.results).startswith(os.path.abspath(args.export) + os.sep):
            return f"--results {args.results} is inside --export {args.export}, which the export replaces"
    for flag, value, check in (
        ("--results", args.results, _writable_file),
        ("--log-dir", args.log_dir, _writable_dir),
        ("--trace-dir", args.trace_dir, _writable_dir),
    ):
        problem = check(flag, value) if value else None
        if problem is not None:
            return problem
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """Why the parsed flags cannot make a run (one line naming the flag, the value and what to pass), or None.
    Reads only the file system (config.json, the data files' presence); the library is imported only to check an
    ``--export`` target or a ``config.json`` without a vocabulary size."""
    for flag, value, low in (
        ("--devices", args.devices, 1),
        ("--max-steps", args.max_steps, 1),
        ("--max-epochs", args.max_epochs, 1),
        ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 2),
        ("--warmup-steps", args.warmup_steps, 0),
        ("--accumulate-grad-batches", args.accumulate_grad_batches, 1),
        ("--val-every", args.val_every, 1),
        ("--update-threads", args.update_threads, 1),
        ("--chunked-loss", args.chunked_loss, 0),
        ("--checkpoint-every", args.checkpoint_every, 1),
        ("--keep-last", args.keep_last, 1),
    ):
        if value is not None and value < low:
            return f"{flag} must be >= {low}, got {value}"
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a positive number, got {args.lr:g}"
    if args.gradient_clip_val is not None and not (
        math.isfinite(args.gradient_clip_val) and args.gradient_clip_val > 0
    ):
        return f"--gradient-clip-val must be a positive number, got {args.gradient_clip_val:g}"
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        return f"--weight-decay must be a number >= 0, got {args.weight_decay:g}"
    if args.max_steps is not None and args.max_epochs is not None:
        return "--max-steps and --max-epochs both say when the run ends: give one"
    if args.val_split is not None and not 0.0 < args.val_split < 1.0:
        return f"--val-split must be a fraction in (0, 1), got {args.val_split:g}"
    if args.val_split is not None and args.val_data is not None:
        return "--val-split holds part of --data out for validation: drop it, or drop --val-data"
    problem = _activation_policy_problem(args.activation_policy) or _lora_problem(args) or _checkpoint_problem(args)
    if problem is not None:
        return problem
    if not args.meta_init and (args.model is not None or args.strategy != "slidedp"):
        return "--no-meta-init applies to SlideDP's random-init model: " + (
            "a --model checkpoint is read straight into the ledger" if args.model else "use --strategy slidedp"
        )
    if args.hardware:
        return "--hardware predicts the step of a --dry-run: add --dry-run"
    if args.trace_dir and args.strategy != "slidedp":
        return "--trace-dir traces SlideDP's lanes: use it with --strategy slidedp"
    if args.param_route == "replicated" and args.grad_route == "host_reduce":
        return (
            "--param-route replicated (a ledger per rank) reduces gradients with an all-reduce on the devices: "
            "use --grad-route gpu_reduce or auto"
        )
    if args.master_on_disk and args.state_dir is None:
        return "--master-on-disk keeps the master in the state file of --state-dir: add --state-dir DIR"
    if args.master_on_disk and (args.precision != "bf16-mixed" or not args.bf16_copy):
        return (
            "--master-on-disk leaves only the BF16 copy in host memory for the devices to read: it needs "
            f"--precision bf16-mixed and the BF16 copy (got --precision {args.precision}"
            f"{'' if args.bf16_copy else ', --no-bf16-copy'})"
        )
    if settings.slidedp_flags(args) and args.strategy != "slidedp":
        return f"{', '.join(settings.slidedp_flags(args))} configure SlideDP: use them with --strategy slidedp"
    if args.precision == "16-mixed" and args.accelerator == "cpu" and args.strategy != "slidedp":
        return (
            f"--precision 16-mixed with --strategy {args.strategy} on --accelerator cpu: Lightning runs bf16 there "
            "instead; use --strategy slidedp (FP16 autocast with loss scaling on the CPU too) or --precision bf16-mixed"
        )
    if args.data is None:
        for flag, value in (
            ("--val-data", args.val_data),
            ("--val-split", args.val_split),
            ("--export", args.export),
            ("--export-dtype", args.export_dtype),
            ("--pack", args.pack or None),
            ("--truncate", args.truncate or None),
        ):
            if value is not None:
                return f"{flag} goes with --data (your JSONL data), not the synthetic task"
        if args.seq_len != settings.DEFAULT_SEQ_LEN:
            return f"--seq-len goes with --data: the synthetic task's rows are {settings.TASK.seq_len} tokens"
    elif args.model is None:
        return "--data needs --model DIR: the tokenizer and chat template come from DIR"
    for flag, path in (("--data", args.data), ("--val-data", args.val_data)):
        problem = _input_file_problem(flag, path) if path is not None else None
        if problem is not None:
            return problem
    if args.model is not None:
        problem = _model_problem(args.model, synthetic=args.data is None, pack=args.pack)
        if problem is not None:
            return problem
    return _fit_problem(args) or check_outputs(args)


def dry_run(args: argparse.Namespace) -> int:
    """Print the job's plan; 0 when it fits (or is tight), 1 when it does not."""
    if args.model is not None and not os.path.exists(args.model):
        build_parser().error(f"--model {args.model} does not exist")
    try:
        job = plan.of_flags(args)
    except (OSError, ValueError) as err:
        build_parser().error(f"--model {args.model}: the plan cannot read it: {' '.join(str(err).split())}")
    lines = job.lines()
    if args.hardware:
        load_simulator()
        try:
            lines.append(plan.predicted_step(args, args.hardware))
        except (OSError, ValueError) as err:
            build_parser().error(f"--hardware {args.hardware}: {' '.join(str(err).split())}")
    print("\n".join(lines))
    return 1 if job.verdict == "does not fit" else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse and check the flags (a bad one: one line on stderr, exit status 2, before anything heavy is
    imported), then run the job (:func:`slidedp_lightning.recipes.job.run`); returns its exit status."""
    args = parse(argv)
    if args.print_config:
        import yaml

        sys.stdout.write(yaml.safe_dump(settings.resolved_config(args), sort_keys=False))
        return 0
    if args.dry_run:  # --model's files alone: a config.json will do
        problem = resolve_model(args)
        if problem is not None:
            build_parser().error(problem)
        return dry_run(args)
    problem = resolve_model(args) or check_args(args)
    if problem is not None:  # before any process starts or any step trains
        build_parser().error(problem)
    early_ranks.begin(args.devices)  # the other ranks import while this one does
    from slidedp_lightning.recipes.job import run

    early_ranks.wait_for_launch()  # in those: until this one's launcher hands them over
    return run(args)


def cli() -> NoReturn:
    """The ``slidedp-finetune`` command (and every rank process it starts): :func:`main`, then exit without the
    interpreter's final garbage collections.

    At exit Python collects the whole heap several times while it tears the modules down; with torch, Lightning and
    transformers loaded that took 2-3 s of a rank's exit, which the launching rank waits for. By then the job has
    written, flushed and closed everything it made (logs, results, checkpoints, the ledger); the heap is frozen
    (``gc.freeze``) so that those collections skip it, while exit handlers still run."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    cli()
