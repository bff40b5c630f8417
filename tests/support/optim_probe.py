"""A callback that writes down what a (resumed) run really trains with: the optimizer's param
groups and the lr schedule at the first training batch, and the module's clip and non-finite
allowance. Tests add it as ``+callbacks.probe._target_=optim_probe.OptimizerProbe``."""

from __future__ import annotations

import json

import lightning as L


class OptimizerProbe(L.Callback):
    def __init__(self, path: str) -> None:
        self.path, self.written = path, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.written:
            return
        self.written = True
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        groups = [
            {k: v for k, v in g.items() if k != "params"}
            for g in trainer.optimizers[0].param_groups
        ]
        seen = {
            "groups": groups,
            "base_lrs": scheduler.base_lrs,
            "last_epoch": scheduler.last_epoch,
            "optimizer": type(trainer.optimizers[0]).__name__,
            "grad_clip": pl_module.optim.grad_clip,
            "skip_nonfinite": pl_module.nonfinite.allowed,
        }
        with open(self.path, "w") as f:
            json.dump(seen, f, default=list)
