"""SLURM auto-requeue under SlideDP: what ``SLURMEnvironment(auto_requeue=True)`` does in Lightning, at a safe point.

Lightning's own handlers save the HPC checkpoint (a collective) inside the signal handler, in the middle of
whatever the rank was running. During a SlideDP run :class:`~slidedp_lightning.process.signals.SignalGuard` only records
the requeue signal and SLURM's SIGTERM; at the end of every training step :class:`RequeueAtStepEnd` has the ranks
agree (a MAX all-reduce of one integer) on what any of them received. Requeue: every rank saves the HPC
checkpoint (``<default_root_dir>/hpc_ckpt_<n>.ckpt``, which Lightning resumes from when the requeued job starts),
then global rank 0 runs ``scontrol requeue <job id>``; training goes on, as in Lightning. SIGTERM: every rank stops
there, exit status 143. A job with its own checkpoints (:class:`SaveAndStopAtStepEnd`) saves at the end of the step
on either signal, then stops.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.states import TrainerFn

from slidedp_lightning.process.signals import REQUEUE, STOP, SignalExit, SignalGuard

log = logging.getLogger(__name__)


def requeue_signal(module: pl.LightningModule | None, guard: SignalGuard) -> int | None:
    """The requeue signal when the module's Trainer fits under ``SLURMEnvironment(auto_requeue=True)`` (the Trainer then
    gets a :class:`RequeueAtStepEnd` callback, once) or has a :class:`SaveAndStopAtStepEnd` callback, else None."""
    trainer = module.trainer if module is not None else None
    if trainer is None:
        return None
    saving = [cb for cb in trainer.callbacks if isinstance(cb, SaveAndStopAtStepEnd)]  # type: ignore[attr-defined]
    if saving and trainer.state.fn == TrainerFn.FITTING:
        saving[0].guard, guard.save_and_stop = guard, True
        return saving[0].signum
    env = trainer._accelerator_connector.cluster_environment
    if not (isinstance(env, SLURMEnvironment) and env.auto_requeue) or trainer.state.fn != TrainerFn.FITTING:
        return None  # only training has steps to save and stop after
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    if not any(isinstance(cb, RequeueAtStepEnd) for cb in callbacks):
        callbacks.append(RequeueAtStepEnd(guard))
    return int(env.requeue_signal or signal.SIGUSR1)


def slurm_job_id() -> str:
    """The job id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task, else ``SLURM_JOB_ID``."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array is not None else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        raise RuntimeError(f"SlideDP cannot requeue the SLURM job: its id {job!r} (SLURM_JOB_ID) is not a job id.")
    return job


class RequeueAtStepEnd(pl.Callback):
    """Acts, at the end of each training step and on every rank together, on the signals the guard recorded."""

    def __init__(self, guard: SignalGuard) -> None:
        self.guard = guard

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        requests = self.guard.take_requests()
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            agreed = torch.tensor([requests], dtype=torch.int64, device=trainer.strategy.root_device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            requests = int(agreed.item())
        if requests & REQUEUE:
            self._save_and_requeue(trainer)
        if requests & STOP:
            log.error("SlideDP rank %d: stopping after step %d (SIGTERM).", trainer.global_rank, trainer.global_step)
            raise SignalExit(signal.SIGTERM)

    @staticmethod
    def _save_and_requeue(trainer: pl.Trainer) -> None:
        for logger in trainer.loggers:  # as Lightning does: every metric written before the job goes
            logger.finalize("finished")
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        trainer.save_checkpoint(path)
        if not trainer.is_global_zero:
            return
        job = slurm_job_id()
        log.info("SlideDP saved %s after step %d; requeueing SLURM job %s", path, trainer.global_step, job)
        try:
            code = subprocess.call(["scontrol", "requeue", job])
        except FileNotFoundError:
            log.warning("SlideDP cannot requeue SLURM job %s: no scontrol on PATH (the checkpoint is saved)", job)
            return
        if code == 0:
            log.info("Requeued SLURM job %s", job)
        else:
            log.warning("Requeuing SLURM job %s failed: scontrol exited with %d (the checkpoint is saved)", job, code)


class SaveAndStopAtStepEnd(pl.Callback):
    """A job that keeps its own checkpoints (``slidedp-finetune --checkpoint-dir``): SIGTERM, or the requeue signal
    (``signum``: SIGUSR1, what ``sbatch --signal=USR1@90`` sends), during training is recorded; at the end of that
    optimizer step (its accumulated batches all done) every rank saves ``path_of(step)`` and stops, exit status 143
    (128 + SIGTERM), so that ``--resume`` continues from exactly there. A second SIGTERM stops at once, unsaved."""

    def __init__(self, path_of: Callable[[int], str], signum: int = int(signal.SIGUSR1)) -> None:
        self.path_of, self.signum = path_of, signum
        self.guard: SignalGuard | None = None  # the strategy's, given when training starts
        self._step = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.guard is None or trainer.global_step == self._step:  # within an accumulation: no step ended
            return
        self._step = trainer.global_step
        requests = self.guard.take_requests()
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            agreed = torch.tensor([requests], dtype=torch.int64, device=trainer.strategy.root_device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            requests = int(agreed.item())
        if not requests:
            return
        path = self.path_of(trainer.global_step)
        if not os.path.exists(path):  # else the step's own checkpoint has just been written
            trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            log.warning(
                "saved %s after step %d on a signal; stopping (resume with --resume)", path, trainer.global_step
            )
        raise SignalExit(signal.SIGTERM)
