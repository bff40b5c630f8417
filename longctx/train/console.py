"""What a run prints: Lightning's messages that do not apply to longctx silenced, a progress
bar in optimizer steps, a one-line model summary, and at the end where the run is and how to
look at it.

Each silenced message says here why it does not apply. Everything else Lightning says (its own
refusals, a GPU left unused) is left as it is.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from longctx.train.callbacks import last_checkpoint_path

# (message prefix, why it does not apply to a longctx run)
SILENCED_WARNINGS = (
    # Lightning's hint to prepend `srun` whenever `srun` is on PATH: a train.py started without
    # srun is a run on this machine; longctx's SLURM launches (scripts/slurm/train.sbatch,
    # hydra/launcher=slurm) start the ranks with srun, and longctx.distributed.slurm checks the
    # allocation against trainer.num_nodes / trainer.devices before anything starts
    ("The `srun` command is available on your system but is not used", "srun"),
    # asks to save the model state from before optimizer.step() for a manual-optimisation
    # test module of Lightning's; longctx's checkpoints are meant to hold the state after the
    # step, at a step boundary, which is what a resume continues from
    ("Using ModelCheckpoint with manual optimization", "checkpoint"),
    # warns that a dataset's __len__ may double-count under several loader workers: longctx's
    # train stream gives each worker its own rounds (longctx.data.streams), so it holds
    ("Your `IterableDataset` has `__len__` defined", "dataset length"),
    # a deprecation inside Lightning's own code, nothing a run's config can change
    ("`isinstance(treespec, LeafSpec)` is deprecated", "Lightning internals"),
)
# info lines of Lightning's logger connector: an advertisement for another logging service;
# longctx logs to W&B or CSV (logger=wandb / logger=csv), chosen in conf/logger
SILENCED_INFO = (
    "💡 Tip: For seamless cloud logging",
    # Lightning's note that it adds no summary of its own: ParameterSummary below replaces it
    "Trainer already configured with model summary callbacks",
    # which accelerators exist (TPUs on every CPU run): preflight chose the device from
    # trainer.accelerator and refuses a missing one, and ParameterSummary's line says where the
    # model runs (Lightning's "GPU available but not used" warning stays)
    "GPU available: ",
    "TPU available: ",
)


class _DropInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(SILENCED_INFO)


def quiet_lightning() -> None:
    """Silence the messages above, for this process (and its spawned ranks, which import this)."""
    for prefix, _why in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropInfo) for f in logger.filters):
            logger.addFilter(_DropInfo())


class ParameterSummary(ModelSummary):
    """One line instead of Lightning's table: its FLOPs column counts a forward pass on an
    example input longctx does not give (so it reads 0), and its per-module rows are one row,
    the model. The FLOPs of a step are ``train/mfu``'s business (peak_flops_per_device)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        params = sum(p.numel() for p in pl_module.parameters())
        trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        device, count = trainer.strategy.root_device.type, trainer.num_devices
        rank_zero_info(
            f"model: {type(getattr(pl_module, 'model', pl_module)).__name__}, {params:,} "
            f"parameters ({trainable:,} trainable), on {device if count == 1 else f'{count} x {device}'}"
        )


class StepProgressBar(RichProgressBar):
    """Lightning's bar counts training batches of an epoch (``Epoch 0/-2`` when only max_steps
    bounds the run, micro-batches under accumulation); this one counts the optimizer steps of
    the run, ``step N/max_steps``."""

    @property
    def total_train_batches(self) -> int | float:
        steps = self.trainer.max_steps
        return steps if steps and steps > 0 else float("inf")

    def _get_train_description(self, current_epoch: int) -> str:
        return "step"

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # a resumed run's first batch
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def get_metrics(self, trainer, pl_module):
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: the run folder says which run
        return metrics


def callbacks(trainer_cfg) -> list[L.Callback]:
    """The console's callbacks for a trainer config (its enable_* switches respected; without
    rich, Lightning's own bar)."""
    found: list[L.Callback] = []
    if trainer_cfg.get("enable_model_summary", True):
        found.append(ParameterSummary())
    if trainer_cfg.get("enable_progress_bar", True) and _RICH_AVAILABLE:
        found.append(StepProgressBar())
    return found


def run_summary(trainer: L.Trainer, output_dir: Path) -> str:
    """Where the run is: its folder, its last checkpoint, and how to look at its curves."""
    path = last_checkpoint_path(trainer)
    saved = f"{path} (step {trainer.global_step}; resume with ckpt_path=last)"
    unsaved = "none written (callbacks.checkpoint.every_n_train_steps is above the steps run)"
    lines = [f"checkpoint: {saved if path.exists() else unsaved}"]
    lines += [f"curves: {line}" for line in _curves(trainer, output_dir)]
    lines.append(f"run folder: {output_dir}")
    return "\n".join(lines)


def _curves(trainer: L.Trainer, output_dir: Path) -> list[str]:
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    lines = []
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            if getattr(run, "offline", False) or getattr(run.settings, "mode", "") == "offline":
                lines.append(f"wandb sync {output_dir / 'wandb'}/offline-run-*  (offline W&B run)")
            else:
                lines.append(f"{run.url}  (W&B)")
        elif isinstance(logger, CSVLogger):
            lines.append(f"{Path(logger.log_dir) / 'metrics.csv'}  (CSV, one row per step)")
    return lines or ["none logged (logger=none)"]
