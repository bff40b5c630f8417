"""Preemption: on a signal, checkpoint at the next optimizer-step boundary and stop cleanly.

The handler only sets a flag; the checkpoint is written from the training loop at a step
boundary (never inside the handler, where a half-finished step or collective could be caught).
All ranks agree on the flag through one tiny all-reduce per step, so a signal delivered to one
process stops every rank at the same step. A signal that arrives during validation is acted on
when validation ends. The checkpoint is ModelCheckpoint's own ``last.ckpt`` (one "last", always
the newest). Data-loader workers ignore these signals (a SIGTERM to the process group reaches
them too): stopping is the main process's job.

Under SLURM a *requeue* signal (SIGUSR1/SIGUSR2: ``sbatch --signal=USR1@90`` sent before the time
limit, or ``scancel --signal=USR1``) also requeues the job once the checkpoint is written: rank 0
leaves a PREEMPTED marker next to it and runs ``scontrol requeue``; the requeued job finds the
marker and resumes (longctx.runs.checkpoints.auto_resume_path). SIGTERM only saves and stops: SLURM
sends it on scancel, and on preemption SLURM requeues by itself when configured to.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

from longctx.distributed.slurm import PREEMPTED_MARKER, requeue_job, under_slurm
from longctx.errors import LongctxError
from longctx.io import atomic_write_text
from longctx.runs.folder import checkpoint_dir, last_checkpoint

if TYPE_CHECKING:
    from longctx.train.module import LongCtxModule


class SaveOnSignal(L.Callback):
    def __init__(
        self,
        signals: list[str] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        requeue_signals: list[str] = ("SIGUSR1", "SIGUSR2"),
        requeue: bool | str = "auto",
    ):
        unknown = [s for s in [*signals, *requeue_signals] if not hasattr(signal, s)]
        if unknown:
            raise LongctxError(f"SaveOnSignal: unknown signal names {unknown}")
        if requeue not in (True, False, "auto"):
            raise LongctxError(f"SaveOnSignal: requeue={requeue!r}; expected true, false or auto")
        self.signals = [getattr(signal, s) for s in signals]
        self.requeue_signals = {getattr(signal, s) for s in requeue_signals}
        # "auto": requeue when running inside a SLURM job
        self.requeue = requeue
        self.requeued: str | None = None
        self.received: int | None = None
        self.saved_path: Path | None = None
        self._previous: dict[int, object] = {}  # signal -> the handler before fit

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # again: Lightning registers its SIGTERM handler after on_fit_start, and that one
        # ends the run with SystemExit(0) and no checkpoint (mid-validation, or when the
        # signal lands after this callback's step-end check); this handler replaces it
        self._install()

    def _install(self) -> None:
        for signum in {*self.signals, *self.requeue_signals}:
            previous = signal.signal(signum, self._handle)
            if previous != self._handle:  # installed twice: keep the handler from before fit
                self._previous.setdefault(signum, previous)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # the process outlives the fit (a sweep, a notebook, a test): its later children must not
        # inherit a handler that turns SIGTERM into "save at the next step" (a pool's terminate
        # would wait on them forever)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.received = signum

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: LongCtxModule, outputs, batch, batch_idx
    ) -> None:
        if not pl_module.at_step_boundary:  # mid-accumulation: wait for the step boundary
            return
        self._save_and_stop_if_signalled(trainer, "")

    def on_validation_end(self, trainer: L.Trainer, pl_module) -> None:
        """A signal that arrives during validation is acted on when validation ends (a safe
        point: ModelCheckpoint saves there too), not only after one more training step."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self._save_and_stop_if_signalled(trainer, " (it arrived during validation)")

    def _save_and_stop_if_signalled(self, trainer: L.Trainer, when: str) -> None:
        stop, requeue_wanted = self._any_rank_received(trainer)
        if not stop or self.saved_path is not None:
            return
        path = last_checkpoint_path(trainer)
        if trainer.checkpoint_callback is not None:
            # the callback's own "last": its next save overwrites this file, never a last-v1
            trainer.checkpoint_callback.last_model_path = str(path)
        trainer.save_checkpoint(path, weights_only=False)  # the full state, to resume
        self.saved_path = path
        rank_zero_info(
            f"signal {self.received}{when}: saved {path} at step {trainer.global_step}; stopping"
        )
        if requeue_wanted and self._should_requeue() and trainer.is_global_zero:
            self._requeue(path)
        trainer.should_stop = True

    def _should_requeue(self) -> bool:
        return self.requeue is True or (self.requeue == "auto" and under_slurm())

    def _requeue(self, checkpoint: Path) -> None:
        """Marker first (the requeued job must find it), then scontrol; the checkpoint is
        already complete on disk, so SLURM may kill this job at any moment from here on."""
        atomic_write_text(checkpoint.parent / PREEMPTED_MARKER, f"{checkpoint.name}\n")
        try:
            self.requeued = requeue_job()
        except (RuntimeError, OSError) as err:  # scontrol missing or refused: stop, say so
            print(f"SaveOnSignal: could not requeue: {err}", file=sys.stderr, flush=True)
            return
        rank_zero_info(f"requeued SLURM job {self.requeued}; it resumes from {checkpoint}")

    def _any_rank_received(self, trainer: L.Trainer) -> tuple[bool, bool]:
        """(some rank got a signal, some rank got a requeue signal)."""
        flags = torch.tensor(
            [float(self.received is not None), float(self.received in self.requeue_signals)]
        )
        if trainer.world_size > 1:
            flags = trainer.strategy.reduce(flags.to(trainer.strategy.root_device), reduce_op="sum")
        return bool(flags[0] > 0), bool(flags[1] > 0)


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where ModelCheckpoint keeps "last" (there is one "last", always the newest)."""
    callback = trainer.checkpoint_callback
    if callback is None or callback.dirpath is None:
        return last_checkpoint(Path(trainer.default_root_dir))
    return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"


class SweepStopped(Exception):
    """A signal stopped one arm of a local multirun: the arms after it must not start (the
    signal was meant for the whole process, not for one arm)."""


def in_local_sweep() -> bool:
    """A multirun whose arms run one after another in this process (Hydra's basic launcher);
    the SLURM launcher runs each arm as its own job, which a signal stops alone."""
    if not HydraConfig.initialized():
        return False
    hydra = HydraConfig.get()
    return hydra.mode == RunMode.MULTIRUN and hydra.launcher._target_.endswith(".BasicLauncher")


def finish_preemption(trainer: L.Trainer, output_dir: Path) -> None:
    """Report this rank; a run that finished without being signalled drops its PREEMPTED
    marker; a signalled arm of a local sweep ends the sweep (SweepStopped)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    print(
        f"longctx: rank {trainer.global_rank}/{trainer.world_size} stopped at step "
        f"{trainer.global_step} on node {node}",
        flush=True,
    )
    signalled = any(getattr(c, "saved_path", None) for c in trainer.callbacks)
    if trainer.is_global_zero and not signalled:
        (checkpoint_dir(output_dir) / PREEMPTED_MARKER).unlink(missing_ok=True)
    if signalled and in_local_sweep():
        raise SweepStopped(
            f"a signal stopped this arm at step {trainer.global_step} ({output_dir}); the sweep "
            "ends here and its later arms do not start. Resume this arm with its overrides and "
            f"hydra.run.dir={output_dir} ckpt_path=last"
        )
