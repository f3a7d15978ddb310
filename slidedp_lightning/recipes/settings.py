"""The fine-tuning job's settings: the synthetic task's shape and token ids, the defaults and choices of every flag
of ``slidedp-finetune``, and the checks that need nothing but them.

Plain Python (the standard library only): ``slidedp-finetune`` reads it before it imports anything heavy, straight
from this file (:mod:`slidedp_lightning_cli.task`), since importing it through this package would run
``slidedp_lightning/__init__.py``, which imports Lightning and torch to register the strategy.
"""

from __future__ import annotations

import json
import os
import re
from argparse import Namespace
from dataclasses import dataclass

IGNORE_INDEX = -100

PAD_ID = 0
BOS_ID = 1
SEP_ID = 2
EOS_ID = 3
NUM_SPECIAL_TOKENS = 4

TASKS = ("reverse", "sort", "copy")


@dataclass(frozen=True)
class TaskSpec:
    """Shape of the synthetic task."""

    task: str = "reverse"
    num_symbols: int = 60
    length: int = 12

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {TASKS}")
        if self.num_symbols < 2:
            raise ValueError(f"num_symbols must be >= 2, got {self.num_symbols}")
        if self.length < 1:
            raise ValueError(f"length must be >= 1, got {self.length}")

    @property
    def vocab_size(self) -> int:
        """Number of token ids the task uses (specials + symbols)."""
        return NUM_SPECIAL_TOKENS + self.num_symbols

    @property
    def seq_len(self) -> int:
        """Tokens per example: BOS + k prompt symbols + SEP + k answer symbols."""
        return 2 * self.length + 2

    @property
    def prompt_len(self) -> int:
        """Tokens per example that belong to the prompt (BOS, symbols, SEP)."""
        return self.length + 2


DEFAULT_CONFIG = "qwen3_tiny.json"

# Task and data-set sizes.  Reversal of 12 symbols out of 60 (vocabulary of 64 ids): a random model scores ~1/60 per
# answer token, a trained tiny model close to 1.0.
TASK = TaskSpec(task="reverse", num_symbols=60, length=12)
TRAIN_SIZE = 20_000
EVAL_SIZE = 1_024
EVAL_BATCH_SIZE = 256
EVAL_SEED_OFFSET = 1_000_003  # eval examples come from a different random stream

# Defaults (tuned on 2 CPU cores, 2 ranks).
DEFAULT_MAX_STEPS = 200
DEFAULT_BATCH_SIZE = 32  # per rank
DEFAULT_LR = 3e-3
DEFAULT_DATA_LR = 1e-5  # --data: a pretrained checkpoint
DEFAULT_WEIGHT_DECAY = 0.01
DEFAULT_SEED = 1234
DEFAULT_SEQ_LEN = 256
PRECISIONS = ("bf16-mixed", "16-mixed", "32-true")
STRATEGIES = ("slidedp", "ddp")
ACCELERATORS = ("cpu", "cuda", "gpu", "auto")
PARAM_ROUTES = ("full", "sharded", "replicated", "auto")
GRAD_ROUTES = ("gpu_reduce", "host_reduce", "auto")
EXPORT_DTYPES = ("bfloat16", "float32")
MIN_CHUNK_BYTES = 64  # the engine's smallest gradient chunk (slidedp_lightning.runtime.config.EngineConfig)
OPTIMIZER_STATES = ("fp32", "int8")  # SlideDPStrategy(optimizer_state=...)
ACTIVATION_MODES = ("none", "full", "selective", "segments", "auto")  # SlideDPStrategy(activation_policy=...)
LR_SCHEDULES = ("cosine", "linear", "constant")  # after the linear warm-up
DEFAULT_LR_SCHEDULE = "cosine"
# A real model (--model): every decoder block recomputed in backward, the loss over the vocabulary computed this
# many tokens at a time (no [batch, seq, vocab] logits), unless --activation-policy / --chunked-loss say otherwise
MODEL_ACTIVATION_POLICY = "full"
MODEL_CHUNKED_LOSS = 1024


# CPU flags (/proc/cpuinfo) under which torch's bf16 matmuls run at least as fast as FP32 (oneDNN's AVX512-BF16 and
# AMX kernels); elsewhere (AVX2 Zen 2/3, Skylake-SP to Ice Lake) they are emulated, on an AVX2 Zen 2 about 150x
# slower than FP32 (docs/PERFORMANCE.md, "Machines")
FAST_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEFAULT_PRECISION = "bf16-mixed"
SLOW_BF16_PRECISION = "32-true"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, flags) of this host's first CPU; ("", empty) where ``cpuinfo`` cannot be read."""
    name, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, flags


# oneDNN (torch's CPU matmuls) capped below AVX512-BF16 by ONEDNN_MAX_CPU_ISA computes bf16 as a CPU without it does
SLOW_BF16_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def fast_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 matmuls fast (:data:`FAST_BF16_FLAGS`, unless ``ONEDNN_MAX_CPU_ISA`` caps
    oneDNN below them); None where its flags cannot be read."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in SLOW_BF16_ONEDNN_ISAS:
        return False
    _, flags = cpu_flags(cpuinfo)
    return bool(flags & set(FAST_BF16_FLAGS)) if flags else None


def default_precision(accelerator: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The job's precision unless ``--precision`` says: bf16-mixed, except on the CPU device of a CPU without fast
    bf16 matmuls, where FP32 (32-true) is the fast one."""
    if accelerator == "cpu" and fast_bf16(cpuinfo) is False:
        return SLOW_BF16_PRECISION
    return DEFAULT_PRECISION


def bf16_note(args: Namespace, chosen: bool, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """What the job says about bf16 on a CPU device without fast bf16 matmuls (None elsewhere): why it runs FP32 by
    default, or (``--precision bf16-mixed`` given) what bf16 costs there."""
    if args.accelerator != "cpu" or fast_bf16(cpuinfo) is not False:
        return None
    model, _ = cpu_flags(cpuinfo)
    cpu = f"this CPU ({model or 'unnamed'}) has neither AVX512-BF16 nor AMX, so torch's bf16 matmuls are emulated"
    if not chosen:
        return f"--precision {SLOW_BF16_PRECISION} by default: {cpu}, far slower than FP32; --precision bf16-mixed asks for bf16"
    if args.precision == "bf16-mixed":
        return f"--precision bf16-mixed: {cpu}, on an AVX2 CPU about 150x slower than FP32; --precision 32-true is fast here"
    return None


def check_vocab(vocab_size: int, spec: TaskSpec, where: str) -> None:
    """Raise ``ValueError`` (naming ``where`` and the fix) when a vocabulary of ``vocab_size`` ids cannot hold
    the task's token ids."""
    if vocab_size < spec.vocab_size:
        raise ValueError(
            f"{where} has a vocabulary of {vocab_size} token ids but the synthetic task needs "
            f"{spec.vocab_size} (ids 0..{spec.vocab_size - 1}); use a model with a larger vocabulary"
        )


def activation_policy(args: Namespace) -> str | None:
    """The activation policy of the run: ``--activation-policy``, else full recomputation for a real model
    (``--model``) under SlideDP, else none (the strategy's default)."""
    if args.activation_policy is not None:
        return None if args.activation_policy == "none" else args.activation_policy
    return MODEL_ACTIVATION_POLICY if args.model is not None and args.strategy == "slidedp" else None


def chunked_loss(args: Namespace) -> int:
    """Tokens per chunk of the loss (``use_chunked_loss``; 0: the model's own loss): ``--chunked-loss``, else
    :data:`MODEL_CHUNKED_LOSS` for a real model (``--model``), else 0."""
    if args.chunked_loss is not None:
        return int(args.chunked_loss)
    return MODEL_CHUNKED_LOSS if args.model is not None else 0


# the SlideDPStrategy options that flags of the same name set, with the strategy's defaults
STRATEGY_FLAG_DEFAULTS: dict[str, object] = {
    "param_route": "full",
    "grad_route": "gpu_reduce",
    "chunk_bytes": None,
    "optimizer_state": "fp32",
    "state_dir": None,
    "master_on_disk": False,
    "bf16_copy": True,
    "activation_policy": None,
    "update_threads": None,
}


def strategy_options(args: Namespace) -> dict[str, object]:
    """The ``SlideDPStrategy`` keyword arguments the flags set, those that differ from the strategy's defaults
    (empty: the registered ``strategy="slidedp"``). The synthetic task's random-init model is built on the meta
    device unless ``--no-meta-init`` (``meta_init``: each unit initialized straight into the ledger, no rank holding
    the whole model)."""
    chosen = {k: getattr(args, k) for k in STRATEGY_FLAG_DEFAULTS} | {"activation_policy": activation_policy(args)}
    options = {k: v for k, v in chosen.items() if v != STRATEGY_FLAG_DEFAULTS[k]}
    state_dir = options.pop("state_dir", None)
    master = options.pop("master_on_disk", False)
    if state_dir is not None:  # --state-dir: the moments (of --optimizer-state's form), --master-on-disk: the master
        from slidedp_lightning.options import StateOnDisk

        options["optimizer_state"] = StateOnDisk(str(state_dir), moments=args.optimizer_state, master=master)
    return options | ({"meta_init": True} if args.model is None and args.meta_init else {})


def slidedp_flags(args: Namespace) -> list[str]:
    """The flags given that configure SlideDP itself (refused with another ``--strategy``)."""
    given = [
        k
        for k, default in STRATEGY_FLAG_DEFAULTS.items()
        if getattr(args, k) != default and not (k == "activation_policy" and args.activation_policy == "none")
    ]
    return ["--no-bf16-copy" if k == "bf16_copy" else "--" + k.replace("_", "-") for k in given]


# --data read through Hugging Face datasets, by suffix (its builders); any other file is JSONL, read line by line
DATASET_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a directory that ``datasets``' ``save_to_disk`` wrote (a Dataset's or a DatasetDict's)."""
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def needs_datasets(path: str) -> bool:
    """Whether ``--data path`` is read through Hugging Face datasets."""
    return os.path.splitext(path)[1].lower() in DATASET_BUILDERS or (os.path.isdir(path) and is_saved_dataset(path))


# --pack: the transformers model types whose forward, given position ids that restart per example and no attention
# mask, keeps each example's attention within itself (its logits equal those of the example alone; checked for each
# by tests/recipes/test_packing.py). Another model type is refused: gpt_oss, for one, mixes the examples of a row.
PACKING_MODEL_TYPES = (
    "qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
    "cohere", "starcoder2", "stablelm", "smollm3", "cohere2", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt2",
)  # fmt: skip


def pack_problem(model_type: object) -> str | None:
    """Why ``--pack`` cannot train a model of ``model_type`` (one line), or None."""
    if model_type in PACKING_MODEL_TYPES:
        return None
    return (
        f"--pack: model type {model_type!r} is not one whose attention is known to keep packed examples apart "
        f"({', '.join(PACKING_MODEL_TYPES)}); drop --pack (one example a row)"
    )


# LoRA (--lora-r): the modules adapted unless --lora-targets names them (peft: every linear layer but the head)
DEFAULT_LORA_TARGETS = "all-linear"


def lora_settings(args: Namespace) -> dict[str, object] | None:
    """peft's LoRA settings the flags ask for (None: full fine-tuning): rank, alpha (default twice the rank),
    dropout and the target modules (a list of names, or ``"all-linear"``)."""
    if args.lora_r is None:
        return None
    targets = args.lora_targets or DEFAULT_LORA_TARGETS
    return {
        "r": args.lora_r,
        "alpha": args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r,
        "dropout": args.lora_dropout,
        "targets": targets if targets == DEFAULT_LORA_TARGETS else [t.strip() for t in targets.split(",") if t.strip()],
    }


# what the command line adds to the job's flags: which file set them, and whether to print them or the plan and stop
NOT_SETTINGS = ("config", "print_config", "dry_run", "hardware", "precision_chosen")


def resolved_config(args: Namespace) -> dict[str, object]:
    """Every setting of a run by its flag's name (``optimizer-state``), as ``--config`` reads it back: the file
    ``--print-config`` prints and each run writes beside its logs."""
    return {k.replace("_", "-"): v for k, v in vars(args).items() if k not in NOT_SETTINGS}


CHECKPOINT_NAME = re.compile(r"^step=(\d+)\.ckpt$")  # the job's checkpoints under --checkpoint-dir


def latest_checkpoint(directory: str) -> str | None:
    """The newest checkpoint (``step=N.ckpt``, the largest N) under ``directory``, or None. A checkpoint is
    written aside and swapped into place, so one under its final name is complete."""
    if not os.path.isdir(directory):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := CHECKPOINT_NAME.match(name))]
    return os.path.join(directory, max(found)[1]) if found else None


def resume_problem(args: Namespace, checkpoint: str) -> str | None:
    """Why the flags cannot resume ``checkpoint`` (one line naming the flag that differs from the run that wrote
    it), or None: what the ledger holds (the moments' format, the BF16 copy, which weights train) must match.
    Reads the distributed checkpoint's ``meta.json`` only; another file (a full checkpoint) is left to the
    strategy's own checks."""
    try:
        with open(os.path.join(checkpoint, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    written, hyper = meta.get("slidedp") or {}, meta.get("hyper_parameters") or {}
    ledger = {
        "--optimizer-state": (written.get("optimizer_state"), args.optimizer_state),
        "--bf16-copy": (written.get("bf16_copy"), args.bf16_copy),
    }
    if "lora" in hyper:  # which weights train (the job's own module records it)
        ledger["--lora-r"] = ((hyper["lora"] or {}).get("r"), args.lora_r)
    for flag, (then, now) in ledger.items():
        if (then is not None or flag == "--lora-r") and then != now:
            return (
                f"--resume {checkpoint}: it was written with {flag} {_shown(then)}, this run has {flag} "
                f"{_shown(now)}; a checkpoint resumes with the flags that wrote it (start a new run to change them)"
            )
    return None


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)
