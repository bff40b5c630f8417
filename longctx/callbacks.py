"""Preemption: on a signal, checkpoint at the next optimizer-step boundary and stop cleanly.

The handler only sets a flag; the checkpoint is written from the training loop at a step
boundary (never inside the handler, where a half-finished step or collective could be caught).
All ranks agree on the flag through one tiny all-reduce per step, so a signal delivered to one
process stops every rank at the same step.
"""

from __future__ import annotations

import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info


class SaveOnSignal(L.Callback):
    def __init__(self, signals: list[str] = ("SIGTERM", "SIGUSR1"), filename: str = "last.ckpt"):
        unknown = [s for s in signals if not hasattr(signal, s)]
        if unknown:
            raise ValueError(f"SaveOnSignal: unknown signal names {unknown}")
        self.signals = [getattr(signal, s) for s in signals]
        self.filename = filename
        self.received: int | None = None
        self.saved_path: Path | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # installed after Lightning's own handlers, which would raise mid-step instead
        for signum in self.signals:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.received = signum

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(pl_module, "_micro", 0) != 0:  # mid-accumulation: wait for the step boundary
            return
        if not self._any_rank_received(trainer):
            return
        path = Path(trainer.checkpoint_callback.dirpath) / self.filename
        trainer.save_checkpoint(path)
        self.saved_path = path
        rank_zero_info(
            f"signal {self.received}: saved {path} at step {trainer.global_step}; stopping"
        )
        trainer.should_stop = True

    def _any_rank_received(self, trainer: L.Trainer) -> bool:
        flag = torch.tensor(float(self.received is not None))
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag.to(trainer.strategy.root_device), reduce_op="sum")
        return bool(flag > 0)
