"""Experiment loggers: W&B (online with a key, offline without) and CSV."""

from __future__ import annotations

import netrc
import os
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

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
    if id_file.is_file():
        return id_file.read_text().strip()
    run_id = uuid.uuid4().hex[:12]
    output_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return run_id


def run_label(cfg: DictConfig) -> str:
    """A run is named by its overrides (the ablation toggles), else by its folder."""
    try:
        from hydra.core.hydra_config import HydraConfig

        name = HydraConfig.get().job.override_dirname
    except ValueError:  # not under Hydra
        name = ""
    return name or Path(cfg.paths.output_dir).name


def make_wandb_logger(cfg: DictConfig, output_dir: Path, settings: DictConfig):
    from lightning.pytorch.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(
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


def make_loggers(cfg: DictConfig, output_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger

    loggers = []
    for kind, settings in (cfg.get("logger") or {}).items():
        if kind == "wandb":
            loggers.append(make_wandb_logger(cfg, output_dir, settings))
        elif kind == "csv":
            loggers.append(CSVLogger(save_dir=str(output_dir), name="csv", version=""))
        else:
            raise ValueError(f"logger.{kind}: unknown logger; expected wandb or csv")
    return loggers
