"""The plan of a fine-tuning job, made before anything loads (``slidedp-finetune --dry-run``, and the first lines of
every run): the model's parameters, the host ledger each form of the optimizer state needs, the host memory the job
will need, what this host has free, and whether it fits; when it does not, the flags that would make it fit.

Plain Python (the standard library only), read by ``slidedp-finetune`` before torch is imported, like
:mod:`~slidedp_lightning.recipes.settings`.  Parameters are counted exactly from the checkpoint's safetensors
headers (each stored tensor once, so a tied head once), or, for a directory with ``config.json`` alone, estimated
from the config (a Qwen3-shaped decoder: see :mod:`slidedp_lightning.steptime.workload`).  The ledger holds, per
trainable parameter, the FP32 master, both Adam moments and the BF16 copy
(:func:`slidedp_lightning.constants.ledger_bytes_per_param`: 14, 8.008 with int8 moments, 6.008 without the copy);
a frozen weight of a LoRA run keeps one copy (BF16 under bf16 compute with the copy kept, else FP32).

Beside the ledger each rank holds its own memory: the libraries, its devices' copies of the units in flight (on
the CPU, host memory), activations and gradients.  :data:`REST_PER_RANK_BYTES` is that rest as the capacity
benchmark measured it at a Qwen3-1.7B shape (docs/PERFORMANCE.md, "At the host's memory limit"); for smaller units it
is an upper bound.  A ledger larger than the memory it goes into cannot work (the run is refused before it is
created); a ledger that fits with less room than the ranks' rest may not, and is said to be tight.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from argparse import Namespace
from dataclasses import dataclass, field, replace
from typing import cast

from slidedp_lightning.constants import MASTER_BYTES, ledger_bytes_per_param, moment_bytes
from slidedp_lightning.recipes.settings import DEFAULT_CONFIG, DEFAULT_PRECISION, activation_policy, lora_settings
from slidedp_lightning.runtime.host_os import mem_available

# each rank's memory beside the ledger, by optimizer state (capacity benchmark, Qwen3-1.7B shape, 32 tokens a
# rank, full recomputation: 3.1 GB exact, 2.3 GB int8)
REST_PER_RANK_BYTES = {"fp32": int(3.1e9), "int8": int(2.3e9)}
SHM_ENV = "SLIDEDP_SHM_DIR"  # where ledgers are created (slidedp_lightning.runtime.ledger.preflight)
GIB = 1024**3


@dataclass(frozen=True)
class Model:
    """What the plan reads of a checkpoint: its parameters and the shapes of its decoder blocks' matrices."""

    params: int
    counted: str  # how: "safetensors headers" or "config.json (estimate)"
    matrices: tuple[tuple[str, int, int], ...] = ()  # (name, rows, cols) of each 2-D weight in a decoder block


@dataclass(frozen=True)
class Setup:
    """The flags that size the job."""

    ranks: int
    optimizer_state: str = "fp32"
    bf16_copy: bool = True
    precision: str = "bf16-mixed"
    param_route: str = "full"
    lora_r: int | None = None
    lora_targets: tuple[str, ...] | str = "all-linear"
    state_dir: str | None = None  # the moments in a state file there (--state-dir)
    master_on_disk: bool = False  # the FP32 master there too (--master-on-disk)

    def flags(self) -> list[str]:
        """The flags that say how this setup differs from the default one."""
        out = ["--optimizer-state int8"] if self.optimizer_state == "int8" else []
        out += [f"--state-dir {self.state_dir}"] if self.state_dir else []
        out += ["--master-on-disk"] if self.master_on_disk else []
        out += [] if self.bf16_copy else ["--no-bf16-copy"]
        out += [f"--lora-r {self.lora_r}"] if self.lora_r else []
        return out


@dataclass(frozen=True)
class Host:
    """The memory this host has free for the job."""

    mem_available: int
    shared_free: int
    shared_dir: str


@dataclass(frozen=True)
class Plan:
    model: Model
    setup: Setup
    host: Host
    trainable: int
    ledger_bytes: int  # every ledger of the host (one, or one per rank on the replicated route)
    rest_bytes: int  # the ranks' own memory beside it (an estimate)
    alternatives: list[tuple[str, Plan]] = field(default_factory=list)
    disk_bytes: int = 0  # the state file (--state-dir): the trainable parameters' moments
    disk_free: int = 0  # free space in --state-dir

    @property
    def need_bytes(self) -> int:
        return self.ledger_bytes + self.rest_bytes

    @property
    def verdict(self) -> str:
        """``fits``; ``tight`` (the ledger fits, the ranks' estimated rest may not); ``does not fit``."""
        if self.ledger_bytes > min(self.host.mem_available, self.host.shared_free) or self.disk_bytes > self.disk_free:
            return "does not fit"
        return "fits" if self.need_bytes <= self.host.mem_available else "tight"

    def fix(self) -> str | None:
        """The flags of the first alternative that fits (smallest change first), or None."""
        return next((flags for flags, plan in self.alternatives if plan.verdict == "fits"), None)

    def lines(self) -> list[str]:
        """The plan as the job prints it."""
        s, h = self.setup, self.host
        mode = ", ".join(s.flags()) or "exact optimizer state (fp32 moments, BF16 copy kept)"
        lines = [
            f"plan: {count(self.model.params)} parameters ({self.model.counted}), {count(self.trainable)} "
            f"trainable; {s.ranks} rank{'s' if s.ranks > 1 else ''}; {mode}",
            f"  ledger {gib(self.ledger_bytes)} ({self.ledger_bytes / max(self.model.params, 1):.2f} B/param)"
            f" + the ranks' own memory, at most {gib(self.rest_bytes)} (measured at 1.7 B; less for smaller "
            f"models) = {gib(self.need_bytes)}",
            f"  host: MemAvailable {gib(h.mem_available)}, {h.shared_dir} free {gib(h.shared_free)}: "
            f"{self.verdict.upper()}",
        ]
        if s.state_dir:
            held = "the FP32 master and the Adam moments" if s.master_on_disk else "the Adam moments"
            lines.insert(2, f"  state file in {s.state_dir}: {gib(self.disk_bytes)} ({held}), "
                            f"free there {gib(self.disk_free)}")  # fmt: skip
        if self.verdict != "fits":
            fits = [f"{flags} ({gib(plan.need_bytes)})" for flags, plan in self.alternatives if plan.verdict == "fits"]
            lines.append("  fits with: " + ("; ".join(fits) if fits else "none of --optimizer-state int8, "
                                            "--no-bf16-copy, --lora-r 8 or fewer --devices"))  # fmt: skip
        by_mode = [
            f"{state}{'' if copy else ', no BF16 copy'}: {gib(self.model.params * ledger_bytes_per_param(state, copy))}"
            for state, copy in (("fp32", True), ("int8", True), ("int8", False))
        ]
        lines.append("  ledger by optimizer state (full fine-tuning): " + "; ".join(by_mode))
        return lines

    def summary(self) -> str:
        """The plan in one line, as every run logs it first (``lines()`` in full: ``--dry-run``)."""
        h = self.host
        fix = self.fix() if self.verdict != "fits" else None
        return (
            f"plan: {count(self.model.params)} parameters, ledger {gib(self.ledger_bytes)} "
            f"({self.ledger_bytes / max(self.model.params, 1):.2f} B/param) + the ranks' own, at most "
            f"{gib(self.rest_bytes)}; MemAvailable {gib(h.mem_available)}, {h.shared_dir} free {gib(h.shared_free)}"
            + (f"; state file {gib(self.disk_bytes)}, {gib(self.disk_free)} free there" if self.setup.state_dir else "")
            + f": {self.verdict}"
            + (f" (fits with {fix})" if fix else "")
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "params": self.model.params,
            "params_counted": self.model.counted,
            "trainable_params": self.trainable,
            "ledger_bytes": self.ledger_bytes,
            "rest_bytes_estimate": self.rest_bytes,
            "mem_available_bytes": self.host.mem_available,
            "shared_free_bytes": self.host.shared_free,
            "state_file_bytes": self.disk_bytes,
            "state_dir_free_bytes": self.disk_free,
            "verdict": self.verdict,
            "fix": self.fix() if self.verdict != "fits" else None,
        }


def count(n: int) -> str:
    """A parameter count in B or M."""
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def gib(n: float) -> str:
    """``n`` bytes in GiB, two decimals."""
    return f"{n / GIB:.2f} GiB"


# ------------------------------------------------------------------------------------------------ the model
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_shapes(path: str) -> dict[str, list[int]]:
    """Each tensor's shape in a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {name: list(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def _is_block_matrix(name: str, shape: list[int]) -> bool:
    return len(shape) == 2 and ".layers." in name and name.endswith(".weight")


def read_model(model: str) -> Model:
    """The parameters of the checkpoint ``model`` (a directory, or a ``config.json``): exact from its safetensors
    files when it has them, else estimated from its config. Raises ``ValueError`` when neither can be read."""
    directory = model if os.path.isdir(model) else os.path.dirname(model)
    files = (
        sorted(f for f in os.listdir(directory or ".") if f.endswith(".safetensors")) if os.path.isdir(model) else []
    )
    if files:
        shapes: dict[str, list[int]] = {}
        for name in files:
            shapes.update(_safetensors_shapes(os.path.join(directory, name)))
        params = sum(_numel(s) for s in shapes.values())
        blocks = tuple((n, s[0], s[1]) for n, s in shapes.items() if _is_block_matrix(n, s))
        return Model(params, "safetensors headers", blocks)
    config_path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(config_path) as f:
        config = json.load(f)
    config = config.get("text_config", config) if isinstance(config, dict) else config
    from slidedp_lightning.steptime.workload import ModelShape  # plain Python

    shape = ModelShape.from_dict(config, os.path.basename(directory) or "model")
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    ffn = shape.intermediate
    block = [("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h)]
    block += [("self_attn.o_proj", h, q), ("mlp.gate_proj", ffn, h), ("mlp.up_proj", ffn, h), ("mlp.down_proj", h, ffn)]
    blocks = tuple((f"model.layers.{i}.{n}.weight", r, c) for i in range(shape.layers) for n, r, c in block)
    return Model(shape.total_params, "config.json (estimate)", blocks)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ------------------------------------------------------------------------------------------------- the host
def read_host() -> Host:
    """MemAvailable, and the free bytes where the ledger goes (``$SLIDEDP_SHM_DIR``, else /dev/shm)."""
    mem = mem_available()
    directory = os.environ.get(SHM_ENV) or "/dev/shm"
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return Host(mem, free, directory)


# ------------------------------------------------------------------------------------------------- the plan
def _lora_params(model: Model, r: int, targets: tuple[str, ...] | str) -> int:
    """LoRA's adapter parameters: r x (rows + cols) for each adapted matrix of the decoder blocks."""
    chosen = [
        (rows, cols)
        for name, rows, cols in model.matrices
        if targets == "all-linear" or any(name.endswith(f".{t}.weight") for t in targets)
    ]
    return sum(r * (rows + cols) for rows, cols in chosen)


def plan(model: Model, setup: Setup, host: Host, alternatives: bool = True) -> Plan:
    """The job's memory on this host, and (``alternatives``) the same job with each flag that shrinks it."""
    per_param = ledger_bytes_per_param(setup.optimizer_state, setup.bf16_copy)
    on_disk = 2 * moment_bytes(setup.optimizer_state) if setup.state_dir else 0.0  # per trainable parameter
    on_disk += MASTER_BYTES if setup.state_dir and setup.master_on_disk else 0  # (it covers trainable parameters)
    per_param -= on_disk
    if setup.lora_r:
        trainable = _lora_params(model, setup.lora_r, setup.lora_targets)
        frozen_copy = 2 if setup.precision == "bf16-mixed" and setup.bf16_copy else 4
        ledger = trainable * per_param + model.params * frozen_copy
    else:
        trainable, ledger = model.params, model.params * per_param
    copies = setup.ranks if setup.param_route == "replicated" else 1
    rest = REST_PER_RANK_BYTES[setup.optimizer_state] * setup.ranks
    disk = (int(trainable * on_disk), shutil.disk_usage(setup.state_dir).free) if setup.state_dir else (0, 0)
    result = Plan(model, setup, host, trainable, int(ledger * copies), rest, [], *disk)
    if alternatives:
        options: list[Setup] = []
        if setup.optimizer_state == "fp32":
            options.append(replace(setup, optimizer_state="int8"))
        if setup.bf16_copy:
            options.append(replace(setup, optimizer_state="int8", bf16_copy=False))
        if not setup.lora_r:
            options.append(replace(setup, lora_r=8, lora_targets="all-linear"))
        options += [replace(setup, ranks=n) for n in range(setup.ranks - 1, 0, -1)]
        for option in options:
            flags = [f for f in option.flags() if f not in setup.flags()]
            if option.ranks != setup.ranks:
                flags.append(f"--devices {option.ranks}")
            result.alternatives.append((" ".join(flags), plan(model, option, host, alternatives=False)))
    return result


def model_path(args: Namespace) -> str:
    """The job's checkpoint: ``--model``, or the config of the random-init tiny model."""
    return args.model or os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", DEFAULT_CONFIG)


def of_flags(args: Namespace) -> Plan:
    """The plan of the job that ``slidedp-finetune``'s checked flags ``args`` describe, on this host."""
    model = model_path(args)
    lora = lora_settings(args)
    targets = lora["targets"] if lora else "all-linear"  # "all-linear" or a list of module names
    setup = Setup(
        ranks=args.devices,
        optimizer_state=args.optimizer_state,
        bf16_copy=args.bf16_copy,
        precision=args.precision,
        param_route=args.param_route,
        lora_r=args.lora_r,
        lora_targets=targets if isinstance(targets, str) else tuple(cast("list[str]", targets)),
        state_dir=getattr(args, "state_dir", None),
        master_on_disk=getattr(args, "master_on_disk", False),
    )
    return plan(read_model(model), setup, read_host())


def predicted_step(args: Namespace, hardware: str) -> str:
    """One line: the step-time model's prediction (simulator) of the job ``args`` describes on the ``hardware``
    profile (a shipped name or a calibrated profile file): step time, tokens/s, and what bounds the step; with
    ``--state-dir`` the state file's disk too (a profile without ``disk_gbps`` is refused, naming it). Plain Python
    (the simulator's modules by name, not the package: the command line loads them by file)."""
    from slidedp_lightning.steptime.graph import StepConfig
    from slidedp_lightning.steptime.profiles import load_profile
    from slidedp_lightning.steptime.simulate import simulate
    from slidedp_lightning.steptime.workload import load_config

    model = model_path(args)
    policy = activation_policy(args) or "none"
    modelled = policy if policy in ("none", "full") else "full"
    profile = load_profile(hardware)
    # the job on a GPU host computes in bf16 unless --precision says otherwise (this host's default need not apply)
    chosen = getattr(args, "precision_chosen", True)
    precision = args.precision if chosen or profile.host_is_device else DEFAULT_PRECISION
    config = StepConfig(
        load_config(model), args.batch_size, args.seq_len, args.devices,
        param_route=args.param_route if args.param_route != "auto" else "full",
        grad_route=args.grad_route if args.grad_route != "auto" else "gpu_reduce",
        chunk_bytes=args.chunk_bytes if isinstance(args.chunk_bytes, int) else None, activation=modelled,
        precision=precision, optimizer_state=args.optimizer_state, bf16_copy=args.bf16_copy, loss_sync=True,
        state_on_disk=getattr(args, "state_dir", None) is not None, master_on_disk=getattr(args, "master_on_disk", False),
    )  # fmt: skip
    sim = simulate(config, profile)
    note = "" if modelled == policy else f"; activations modelled as {modelled!r}, the run has {policy!r}"
    return (
        f"  predicted on {profile.name} ({args.devices} GPU{'s' if args.devices > 1 else ''}, batch "
        f"{args.batch_size} x {args.seq_len} tokens a GPU{note}): step {sim.step_time:.3f} s, "
        f"{sim.tokens_per_s:,.0f} tokens/s, {sim.bottleneck}"
    )
