"""One Lightning training job for the multi-process tests: ``python job.py CONFIG.json``.

Writes ``losses_rank{r}.json`` per rank and ``final_state.pt`` (rank 0) into the config's ``out`` folder.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import slidedp_lightning  # noqa: F401  (registers the strategy)
from slidedp_lightning import SlideDPStrategy

VOCAB, SEQ = 96, 24


def tiny_config(tied: bool, layers: int = 2) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )


def tiny_moe_config(layers: int = 2) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


class Tokens(Dataset):
    """Sequences with a learnable rule (each token = previous + 1 mod VOCAB after a random start)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        noise = (torch.rand(n, SEQ, generator=g) < 0.1) * torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.data = (start + torch.arange(SEQ) + noise) % VOCAB

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class TinyLM(L.LightningModule):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        torch.manual_seed(self.cfg.get("init_seed", 1234))
        if self.cfg.get("arch") == "moe":
            self.model = Qwen3MoeForCausalLM(tiny_moe_config(self.cfg.get("layers", 2)))
        else:
            self.model = Qwen3ForCausalLM(tiny_config(self.cfg["tied"], self.cfg.get("layers", 2)))
        if self.cfg.get("loss_chunk"):
            from slidedp_lightning import use_chunked_loss

            use_chunked_loss(self.model, self.cfg["loss_chunk"])
        if self.cfg.get("init_from"):
            self.load_state_dict(torch.load(self.cfg["init_from"]))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == self.cfg.get("raise_at_step", -1):
            raise RuntimeError("deliberate failure in training_step")
        kill = batch_idx == self.cfg.get("kill_at_step", -1) and self.global_rank == self.cfg.get("kill_rank", 1)
        where = self.cfg.get("kill_in", "forward")
        if kill and where == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        if kill and where == "update":  # on the CPU update lane thread, inside this step's first update
            from slidedp_lightning.runtime import update

            def die(lane, task):
                os.kill(os.getpid(), signal.SIGKILL)

            update.UpdateLane._apply = die
        loss = self.model(input_ids=batch, labels=batch).loss
        if kill and where == "backward":  # once backward has started (the loss's gradient exists)
            loss.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
        if batch_idx == self.cfg.get("nan_at_step", -1) and self.global_rank == self.cfg.get("nan_rank", 0):
            loss = loss * float("nan")  # a non-finite gradient on this rank only
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.cfg.get("lr", 3e-3),
            betas=(0.9, 0.95),
        )
        warm = 5
        if self.cfg.get("constant_lr"):
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (1 - s / 200))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        per_batch = self.cfg["batch"] * self.cfg["devices"] * self.cfg.get("num_nodes", 1)
        data = Tokens(self.cfg.get("data_batches", self.cfg["steps"]) * per_batch, seed=7)
        if self.cfg.get("constant_data"):  # every sample the same: batch order and sharding cannot matter
            data.data = Tokens(1, seed=7).data.expand_as(data.data).clone()
        if "drop_batch" in self.cfg:  # batch k leaves the data; later batches move up (every rank loads all data)
            assert not self.cfg.get("distributed_sampler", True), "Lightning's sampler shuffles: order would change"
            k, per_batch = self.cfg["drop_batch"], self.cfg["batch"]
            data.data = torch.cat([data.data[: k * per_batch], data.data[(k + 1) * per_batch :]])
        return DataLoader(data, batch_size=self.cfg["batch"], shuffle=False)

    def on_train_start(self) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is None:
            return
        if self.cfg.get("dump_initial") and self.global_rank == 0:
            torch.save(engine.state_dict(), os.path.join(self.cfg["out"], "initial_state.pt"))
        mapped = set()
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and "slidedp-" in parts[5]:
                    mapped.add((parts[4], parts[5].strip()))
        stats = engine.ledger_stats()
        info = {"mapped": sorted(mapped), "nbytes": stats.nbytes, "num_params": stats.num_params}
        with open(os.path.join(self.cfg["out"], f"ledger_rank{self.global_rank}.json"), "w") as f:
            json.dump(info, f)

    def on_train_end(self) -> None:
        out = self.cfg["out"]
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:  # memory the ledger file holds after training (pages are allocated when written)
            with open(os.path.join(out, f"allocated_rank{self.global_rank}.json"), "w") as f:
                stats = engine.ledger_stats()
                json.dump({"allocated": stats.allocated_bytes, "nbytes": stats.nbytes}, f)
        with open(os.path.join(out, f"losses_rank{self.global_rank}.json"), "w") as f:
            json.dump(self.losses, f)


class SaveAt(L.Callback):
    """Save a checkpoint after optimizer step ``step``; ``kill_rank`` SIGKILLs itself in the middle of the save
    (its tensors written, before the checkpoint is complete)."""

    def __init__(self, step: int, path: str, kill_rank: int | None = None) -> None:
        self.step, self.path, self.kill_rank = step, path, kill_rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.kill_rank == trainer.global_rank:
            from slidedp_lightning import checkpoint

            real = checkpoint.dcp.save

            def save_then_die(*args, **kwargs):
                real(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            checkpoint.dcp.save = save_then_die
        trainer.save_checkpoint(self.path)


def fit(cfg: dict) -> int:
    """Train one configuration; returns the global rank."""
    if cfg["strategy"] == "slidedp":
        from slidedp_lightning.autopolicy import AutoPolicy

        activations = cfg.get("activations")
        if cfg.get("memory_budget") is not None:
            activations = AutoPolicy(memory_budget=cfg["memory_budget"])
        strategy = SlideDPStrategy(
            grad_route=cfg.get("grad_route", "gpu_reduce"),
            param_route=cfg.get("param_route", "full"),
            chunk_bytes=cfg.get("chunk_bytes"),
            update_threads=cfg.get("update_threads"),
            prefetch_window=cfg.get("window", 2),
            meta_init=cfg.get("meta_init", False),
            activation_policy=activations,
            update=cfg.get("update", "auto"),
            checkpoint_format=cfg.get("checkpoint_format", "distributed"),
            host_layout=cfg.get("host_layout", "replicated"),
            timeout=timedelta(seconds=cfg.get("pg_timeout", 60)),
        )
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(timeout=timedelta(seconds=cfg.get("pg_timeout", 60))) if cfg["devices"] > 1 else "auto"
    module = TinyLM(cfg)
    plugins, precision = [], cfg.get("precision", "32-true")
    if precision == "16-mixed":  # Lightning maps 16-mixed to bf16-mixed on the CPU: ask for fp16 explicitly
        if cfg["strategy"] == "slidedp":
            from slidedp_lightning import SlideDPPrecision

            plugins.append(SlideDPPrecision("16-mixed", "cpu"))
        else:
            from lightning.pytorch.plugins.precision import MixedPrecision

            plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
        precision = None
    callbacks: list = []
    if cfg.get("trace_dir") and cfg["strategy"] == "slidedp":
        from slidedp_lightning import LaneTrace

        callbacks.append(LaneTrace(cfg["trace_dir"]))
    if "save_at" in cfg:
        path = cfg.get("save_path", os.path.join(cfg["out"], "ck"))
        callbacks.append(SaveAt(cfg["save_at"], path, cfg.get("kill_in_save")))
    trainer = L.Trainer(
        callbacks=callbacks,
        strategy=strategy,
        accelerator=cfg.get("accelerator", "cpu"),
        devices=cfg["devices"],
        precision=precision,
        plugins=plugins,
        num_nodes=cfg.get("num_nodes", 1),
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=cfg["out"],
        use_distributed_sampler=cfg.get("distributed_sampler", True),
        gradient_clip_val=cfg.get("clip"),
        gradient_clip_algorithm=cfg.get("clip_algorithm", "norm"),
        accumulate_grad_batches=cfg.get("accumulate", 1),
    )
    trainer.fit(module, ckpt_path=cfg.get("ckpt_path"))
    if trainer.global_rank == 0:
        torch.save(
            {k: (v.cpu() if v.is_cuda else v).detach().clone() for k, v in module.state_dict().items()},
            os.path.join(cfg["out"], "final_state.pt"),
        )
    return trainer.global_rank


def main(path: str) -> None:
    """One job, or with ``variants`` ({name: knobs}) one fit per variant in the same processes (outputs under
    ``out/<name>``), which saves the start-up of a job per configuration."""
    with open(path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    variants = cfg.pop("variants", None)
    if variants is None:
        rank = fit(cfg)
    else:
        failed = []
        for name, knobs in variants.items():
            out = os.path.join(cfg["out"], name)
            os.makedirs(out, exist_ok=True)
            try:
                rank = fit({**cfg, **knobs, "out": out})
            except Exception:
                if not cfg.get("keep_going"):
                    raise
                import traceback  # one rank only: a failed variant is written down and the next one runs

                rank = 0
                failed.append(name)
                with open(os.path.join(out, "error.txt"), "w") as f:
                    f.write(traceback.format_exc())
        if failed:
            print(f"variants failed: {failed}", file=sys.stderr)
            sys.exit(1)
    # leave no gloo threads to static destructors at interpreter exit (they can abort the process)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # the very last statement: this rank ran main() to the end (see conftest.EXIT_ABORT)
    with open(os.path.join(cfg["out"], f"done_rank{rank}"), "w") as f:
        f.write("ok\n")


if __name__ == "__main__":
    main(sys.argv[1])
