"""Experiment loggers: W&B (online with a key, offline without) and CSV."""

from __future__ import annotations

import csv
import netrc
import os
import uuid
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from omegaconf import DictConfig, OmegaConf

from longctx.errors import LongctxError
from longctx.io import atomic_write_text, own_bytes, require_plain_file, write_once

WANDB_ID_FILE = "wandb_run_id"


def wandb_mode(requested: str) -> str:
    """ "auto" is online when a W&B key is configured (env or ~/.netrc), offline otherwise."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        has_key = netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        has_key = False
    return "online" if has_key else "offline"


def persistent_run_id(output_dir: Path) -> str:
    """The run folder's W&B id: created once, reused when the run resumes (same W&B run)."""
    id_file = output_dir / WANDB_ID_FILE
    if (kept := own_bytes(id_file)) is not None:  # a link is not the run's: replaced below
        return kept.decode(errors="replace").strip()
    output_dir.mkdir(parents=True, exist_ok=True)
    # every rank of a job builds its loggers at once: the first id written is the one all use
    return write_once(id_file, uuid.uuid4().hex[:12].encode()).decode(errors="replace").strip()


def run_label(cfg: DictConfig) -> str:
    """A run is named by its overrides (the ablation toggles), else by its folder."""
    name = HydraConfig.get().job.override_dirname if HydraConfig.initialized() else ""
    return name or Path(cfg.paths.output_dir).name


def make_wandb_logger(cfg: DictConfig, output_dir: Path, settings: DictConfig):
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    logger = WandbLogger(
        project=settings.project,
        entity=settings.get("entity"),
        save_dir=str(output_dir),
        name=run_label(cfg),
        group=cfg.get("group"),
        tags=list(cfg.get("tags") or []),
        id=persistent_run_id(output_dir),
        resume="allow",
        mode=wandb_mode(settings.get("mode", "auto")),
        config=OmegaConf.to_container(cfg, resolve=True),
    )
    # Lightning passes anonymous=None, a setting wandb >= 0.22 ignores and warns about on every
    # start; not passing it changes nothing else
    logger._wandb_init.pop("anonymous", None)
    return logger


def make_loggers(cfg: DictConfig, output_dir: Path) -> list:
    loggers = []
    for kind, settings in (cfg.get("logger") or {}).items():
        if kind == "wandb":
            loggers.append(make_wandb_logger(cfg, output_dir, settings))
        elif kind == "csv":
            loggers.append(HistoryCSVLogger(save_dir=str(output_dir), name="csv", version=""))
        else:
            raise LongctxError(f"logger.{kind}: unknown logger; expected wandb or csv")
    return loggers


class _AppendingWriter(ExperimentWriter):
    """Lightning's writer deletes an existing metrics.csv when it starts; this one keeps its
    rows and header, and appends. It appends in place (a run logs every step: rewriting the
    history at every flush would cost its square), so the file must be the run's own: a link or
    a second hard link there is refused by name, never written through (replacing it would lose
    the history it stands for). hparams.yaml is written fresh, a link there replaced."""

    def _check_log_dir_exists(self) -> None:
        require_plain_file(self.metrics_file_path, "the metrics log")
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = next(csv.reader(f), [])

    def log_hparams(self, params: dict) -> None:
        self.hparams.update(params)
        # what Lightning's save_hparams_to_yaml writes (OmegaConf's YAML), but never in place
        atomic_write_text(
            Path(self.log_dir) / self.NAME_HPARAMS_FILE, OmegaConf.to_yaml(self.hparams)
        )


class HistoryCSVLogger(CSVLogger):
    """CSVLogger that keeps a run's metrics history across resumes: a resumed run appends to
    ``csv/metrics.csv``. Steps redone after a crash appear again further down; readers keep
    the last row of a step (studies.analysis.csv_rows)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
