"""Faults injected into a train.py subprocess at an exact point (tests/test_fault_injection.py).

Added as a Hydra callback: ``+callbacks.fault._target_=fault_injection.Fault
+callbacks.fault.kind=KIND +callbacks.fault.step=N`` with ``tests/`` on PYTHONPATH. Injecting
from inside the run makes each scenario deterministic: the fault lands at step N, not whenever
a polling test happens to look.

Kinds:
  sigterm_group       SIGTERM to the whole process group (what scancel / Ctrl-C / timeout
                      send: the data-loader workers get it too) after optimizer step N
  sigterm_validation  the same, from inside the validation that follows step N
  kill_in_save        kill -9 half-way through writing the first checkpoint at or after step N
                      (the bytes on disk are a truncated checkpoint)
  crash               kill -9 before training step N (a crash / OOM kill between checkpoints)
  nan_loss            the final norm's output is NaN in the first micro-batch after step N (so
                      step N + 1's loss and gradients are NaN; the weights stay finite)
"""

from __future__ import annotations

import io
import os
import signal

import lightning as L
import torch

KINDS = ("sigterm_group", "sigterm_validation", "kill_in_save", "crash", "nan_loss")


class Fault(L.Callback):
    def __init__(self, kind: str, step: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"Fault.kind={kind!r}; expected one of {KINDS}")
        self.kind, self.step, self.fired = kind, step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.kind == "crash" and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "nan_loss" and trainer.global_step == self.step and not self.fired:
            self._fire(lambda: _nan_once(pl_module.model.norm))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self.fired:
            return
        if self.kind == "sigterm_group":
            self._fire(lambda: os.killpg(os.getpgrp(), signal.SIGTERM))
        elif self.kind == "kill_in_save":
            self._fire(_kill_during_next_save)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *_) -> None:
        if self.kind == "sigterm_validation" and trainer.global_step == self.step:
            self._fire(lambda: os.killpg(os.getpgrp(), signal.SIGTERM))

    def _fire(self, action) -> None:
        self.fired = True
        print(f"fault_injection: {self.kind} at step {self.step}", flush=True)
        action()


def _nan_once(module: torch.nn.Module) -> None:
    """``module``'s next output is NaN, once."""

    def poison(_module, _inputs, output):
        handle.remove()
        return output * float("nan")

    handle = module.register_forward_hook(poison)


def _kill_during_next_save() -> None:
    """The next torch.save into a file writes half its bytes, syncs them, and kill -9s."""
    real_save = torch.save

    def half_save(obj, f, *args, **kwargs):
        if isinstance(f, str | os.PathLike):
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = half_save
