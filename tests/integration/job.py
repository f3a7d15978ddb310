"""One Lightning training job for the multi-process tests: ``python job.py CONFIG.json``.

CONFIG.json holds a ``JobConfig`` (tests/integration/job_config.py). Writes ``losses_rank{r}.json`` per rank and
``final_state.pt`` (rank 0) into the config's ``out`` folder. A SlideDP job's other ranks start with the script, before
its imports, as ``slidedp-finetune``'s do (``slidedp_lightning.process.early_ranks``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from slidedp_lightning_cli.task import early_ranks


def _slidedp_ranks(path: str) -> int:
    """The local ranks of a SlideDP job of this configuration (1 for DDP's and the single-device references)."""
    cfg = json.loads(Path(path).read_text())
    variants = (cfg.get("variants") or {}).values()
    strategies = {cfg["strategy"], *(knobs.get("strategy", cfg["strategy"]) for knobs in variants)}
    return cfg["devices"] if strategies == {"slidedp"} else 1


if __name__ == "__main__":  # as slidedp-finetune does: the other ranks start now and import while this one does
    early_ranks.begin(_slidedp_ranks(sys.argv[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import slidedp_lightning  # noqa: E402  (registers the strategy)
from slidedp_lightning import SlideDPStrategy  # noqa: E402

# run as a script: the repository root makes the tests package importable
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests import helpers  # noqa: E402
from tests.helpers import Tokens  # noqa: E402
from tests.integration import library_models  # noqa: E402
from tests.integration.job_config import JobConfig  # noqa: E402

VOCAB, SEQ = 96, 24


def tiny_config(tied: bool, layers: int = 2, vocab: int = VOCAB) -> Qwen3Config:
    """The job's dense model: ``tests.helpers.tiny_config`` at the job's vocabulary and sequence length."""
    return helpers.tiny_config(tied, layers, vocab=vocab, max_positions=SEQ)


def tiny_moe_config(layers: int = 2, vocab: int = VOCAB) -> Qwen3MoeConfig:
    """The job's MoE model: ``tests.helpers.tiny_moe_config`` at the job's vocabulary and sequence length."""
    return helpers.tiny_moe_config(layers, vocab=vocab, max_positions=SEQ)


class TinyLM(L.LightningModule):
    def __init__(self, cfg: JobConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = None
        self.losses: list[float] = []
        self.torch_threads = 0  # set by every training step

    def configure_model(self) -> None:
        if self.model is not None:
            return
        cfg = self.cfg
        torch.manual_seed(cfg.init_seed)
        # a reference draws its weights on the host, as SlideDP does: under a CUDA root device (the reference
        # strategies' init device) the CUDA generator would draw others and the two runs would start apart
        with torch.device("cpu") if cfg.strategy != "slidedp" else contextlib.nullcontext():
            self._build()
        self._write_initial_fingerprint()

    def _build(self) -> None:
        cfg = self.cfg
        if cfg.pretrained:  # SlideDP: read into the ledger; DDP: transformers' from_pretrained
            self.model = slidedp_lightning.from_pretrained(cfg.pretrained, attn_implementation="eager")
        elif cfg.library:
            self.model = library_models.build(cfg.library, vocab=cfg.vocab, seq=SEQ)
        elif cfg.model:
            config = helpers.family_config(cfg.model, cfg.tied, cfg.layers, vocab=cfg.vocab, max_positions=SEQ)
            self.model = AutoModelForCausalLM.from_config(config)
        elif cfg.arch == "moe":
            self.model = Qwen3MoeForCausalLM(tiny_moe_config(cfg.layers, cfg.vocab))
        else:
            self.model = Qwen3ForCausalLM(tiny_config(cfg.tied, cfg.layers, cfg.vocab))
        if cfg.loss_chunk:
            from slidedp_lightning import use_chunked_loss

            use_chunked_loss(self.model, cfg.loss_chunk)
        if cfg.init_from:
            self.load_state_dict(torch.load(cfg.init_from))
        for name, p in self.model.named_parameters():
            if any(name.startswith(prefix) for prefix in cfg.freeze or ()):
                p.requires_grad_(False)

    def _write_initial_fingerprint(self) -> None:
        """``init_rank{r}.json``: a hash of each materialized parameter as built, so that a comparison can tell
        runs that started from different weights from runs that trained apart (none on the meta device)."""
        params = list(self.model.named_parameters())
        if any(p.is_meta for _, p in params):
            return
        digests = {
            name: hashlib.sha256(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, p in params
        }
        with open(os.path.join(self.cfg.out, f"init_rank{self.global_rank}.json"), "w") as f:
            json.dump(digests, f)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        cfg = self.cfg
        self.torch_threads = torch.get_num_threads()  # what the forward and backward of this rank run on
        if batch_idx == cfg.raise_at_step:
            raise RuntimeError("deliberate failure in training_step")
        kill = batch_idx == cfg.kill_at_step and self.global_rank == cfg.kill_rank
        where = cfg.kill_in
        if kill and where == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and where == "update":  # on the CPU update lane thread, inside this step's first update
            from slidedp_lightning.runtime.lanes import update

            def die(lane, task):
                os.kill(os.getpid(), signal.SIGKILL)

            update.UpdateLane._apply = die
        if batch_idx == 0 and self.global_rank == cfg.slow_writes_rank:  # on its I/O threads, from now on
            from slidedp_lightning.runtime.ledger import disk

            write = disk.StateFile.write_from

            def slow_write(state, offset, buf):
                time.sleep(0.3)
                write(state, offset, buf)

            disk.StateFile.write_from = slow_write
        if cfg.library:
            loss = library_models.lm_loss(cfg.library, self.model, batch)
        else:
            loss = self.model(input_ids=batch, labels=batch).loss
        if kill and where == "backward":  # once backward has started (the loss's gradient exists)
            loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        if batch_idx == cfg.nan_at_step and self.global_rank == cfg.nan_rank:
            loss = loss * float("nan")  # a non-finite gradient on this rank only
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]  # frozen ones (cfg.freeze) left out
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.cfg.lr,
            betas=(0.9, 0.95),
        )
        warm = 5
        if self.cfg.constant_lr:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (1 - s / 200))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        cfg = self.cfg
        per_batch = cfg.batch * cfg.devices * cfg.num_nodes
        n_batches = cfg.steps if cfg.data_batches is None else cfg.data_batches
        data = Tokens(n_batches * per_batch, seed=7, vocab=cfg.vocab, seq=SEQ)
        if cfg.constant_data:  # every sample the same: batch order and sharding cannot matter
            data.data = Tokens(1, seed=7, vocab=cfg.vocab, seq=SEQ).data.expand_as(data.data).clone()
        if cfg.drop_batch is not None:  # batch k leaves the data; later batches move up (every rank loads all data)
            assert not cfg.distributed_sampler, "Lightning's sampler shuffles: order would change"
            k, per_batch = cfg.drop_batch, cfg.batch
            data.data = torch.cat([data.data[: k * per_batch], data.data[(k + 1) * per_batch :]])
        return DataLoader(data, batch_size=cfg.batch, shuffle=False)

    def on_train_start(self) -> None:
        sampler = getattr(self, "anon_sampler", None)
        if sampler is not None:  # the engine is built and the checkpoint (if any) restored: the setup's peak
            with open(os.path.join(self.cfg.out, f"memory_rank{self.global_rank}.json"), "w") as f:
                json.dump({"anon_peak": sampler.stop(), "anon_base": sampler.base}, f)
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is None:
            return
        if self.cfg.dump_initial and self.global_rank == 0:
            torch.save(engine.state_dict(), os.path.join(self.cfg.out, "initial_state.pt"))
        mapped = set()  # (device, inode, path) of every shared mapping of a file with no name (the ledger's)
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                name = parts[5].strip() if len(parts) == 6 else ""
                if "s" in parts[1] and ("/memfd:slidedp-ledger" in name or re.search(r"/#\d+ \(deleted\)$", name)):
                    mapped.add((parts[3], parts[4], name))
        stats = engine.ledger_stats()
        from slidedp_lightning.runtime.ledger.preflight import shm_dir

        st = os.statvfs(shm_dir())
        info = {
            "mapped": sorted(mapped),
            "kind": engine.ledger.file.kind,  # "private memory of this process" for a ledger no other rank maps
            "nbytes": stats.nbytes,
            "num_params": stats.num_params,
            "dir_entries": sorted(os.listdir(shm_dir())),  # the ledger directory while the ledger is alive
            "dir_used": (st.f_blocks - st.f_bfree) * st.f_frsize,
        }
        with open(os.path.join(self.cfg.out, f"ledger_rank{self.global_rank}.json"), "w") as f:
            json.dump(info, f)

    def on_train_end(self) -> None:
        out = self.cfg.out
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:  # memory the ledger file holds after training (pages are allocated when written)
            with open(os.path.join(out, f"allocated_rank{self.global_rank}.json"), "w") as f:
                stats = engine.ledger_stats()
                json.dump({"allocated": stats.allocated_bytes, "nbytes": stats.nbytes}, f)
        with open(os.path.join(out, f"losses_rank{self.global_rank}.json"), "w") as f:
            json.dump(self.losses, f)
        with open(os.path.join(out, f"threads_rank{self.global_rank}.json"), "w") as f:
            json.dump(self.torch_threads, f)


class SaveAt(L.Callback):
    """Save a checkpoint after optimizer step ``step``; ``kill_rank`` SIGKILLs itself in the middle of the save
    (its tensors written, before the checkpoint is complete)."""

    def __init__(self, step: int, path: str, kill_rank: int | None = None) -> None:
        self.step, self.path, self.kill_rank = step, path, kill_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.kill_rank == trainer.global_rank:
            from slidedp_lightning.checkpoints import distributed as checkpoint

            real = checkpoint.dcp.save

            def save_then_die(*args, **kwargs):
                real(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            checkpoint.dcp.save = save_then_die
        trainer.save_checkpoint(self.path)


class AnonPeak(threading.Thread):
    """The peak of this process's RssAnon (private memory: a ledger of several ranks is shared, mapped files are
    page cache),
    sampled every 2 ms until stopped."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = self.peak = _rss_anon()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.002)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _rss_anon())


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def fit(cfg: JobConfig) -> int:
    """Train one configuration; returns the global rank."""
    timeout = timedelta(seconds=cfg.pg_timeout)
    if cfg.strategy == "slidedp":
        from slidedp_lightning.autopolicy import AutoPolicy

        options = cfg.strategy_options()
        if cfg.state_on_disk:
            from slidedp_lightning import StateOnDisk

            state_dir = os.path.join(cfg.out, "state")
            os.makedirs(state_dir, exist_ok=True)
            options["optimizer_state"] = StateOnDisk(state_dir, moments=cfg.optimizer_state, master=cfg.master_on_disk)
        if cfg.memory_budget is not None:
            options["activation_policy"] = AutoPolicy(memory_budget=cfg.memory_budget)
        strategy = SlideDPStrategy(**options, timeout=timeout)
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(timeout=timeout) if cfg.devices > 1 else "auto"
    module = TinyLM(cfg)
    if cfg.record_memory:
        module.anon_sampler = AnonPeak()
        module.anon_sampler.start()
    plugins, precision = [], cfg.precision
    if precision == "16-mixed":  # Lightning maps 16-mixed to bf16-mixed on the CPU: ask for fp16 explicitly
        if cfg.strategy == "slidedp":
            from slidedp_lightning import SlideDPPrecision

            plugins.append(SlideDPPrecision("16-mixed", "cpu"))
        else:
            from lightning.pytorch.plugins.precision import MixedPrecision

            plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        precision = None
    callbacks: list = []
    if cfg.trace_dir and cfg.strategy == "slidedp":
        from slidedp_lightning import LaneTrace

        callbacks.append(LaneTrace(cfg.trace_dir))
    if cfg.save_at is not None:
        path = cfg.save_path or os.path.join(cfg.out, "ck")
        callbacks.append(SaveAt(cfg.save_at, path, cfg.kill_in_save))
    trainer = L.Trainer(
        callbacks=callbacks,
        strategy=strategy,
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        precision=precision,
        plugins=plugins,
        num_nodes=cfg.num_nodes,
        max_steps=cfg.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=cfg.out,
        use_distributed_sampler=cfg.distributed_sampler,
        gradient_clip_val=cfg.clip,
        gradient_clip_algorithm=cfg.clip_algorithm,
        accumulate_grad_batches=cfg.accumulate,
    )
    trainer.fit(module, ckpt_path=cfg.ckpt_path)
    if trainer.global_rank == 0:
        torch.save(
            {k: (v.cpu() if v.is_cuda else v).detach().clone() for k, v in module.state_dict().items()},
            os.path.join(cfg.out, "final_state.pt"),
        )
    return trainer.global_rank


def main(path: str) -> None:
    """One job, or with ``variants`` ({name: knobs}) one fit per variant in the same processes (outputs under
    ``out/<name>``), which saves the start-up of a job per configuration."""
    cfg = JobConfig.from_json(path)
    torch.set_num_threads(1)
    if cfg.variants is None:
        rank = fit(cfg)
    else:
        failed = []
        for name in cfg.variants:
            variant = cfg.variant(name)
            os.makedirs(variant.out, exist_ok=True)
            try:
                rank = fit(variant)
            except Exception:
                if not cfg.keep_going:
                    raise
                import traceback  # one rank only: a failed variant is written down and the next one runs

                rank = 0
                failed.append(name)
                with open(os.path.join(variant.out, "error.txt"), "w") as f:
                    f.write(traceback.format_exc())
        if failed:
            print(f"variants failed: {failed}", file=sys.stderr)
            sys.exit(1)
    # leave no gloo threads to static destructors at interpreter exit (they can abort the process)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # the very last statement: this rank ran main() to the end (see conftest.EXIT_ABORT)
    with open(os.path.join(cfg.out, f"done_rank{rank}"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    early_ranks.wait_for_launch()
    main(sys.argv[1])
    gc.freeze()  # exit without collecting the heap again (see slidedp_lightning_cli.finetune.cli)
