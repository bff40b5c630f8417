"""Checkpoints are written atomically: a crash mid-write never leaves a file a resume would trust."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save to a temp file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        atomic_torch_save(checkpoint, path)


def existing_checkpoint(path: Path) -> Path | None:
    """``path`` (a file, or a sharded FSDP folder), else the ``.old`` copy an interrupted
    folder swap leaves (longctx.distributed.fsdp.swap_into_place), else None."""
    for candidate in (path, path.with_name(path.name + ".old")):
        if candidate.is_file() or (candidate.is_dir() and any(candidate.iterdir())):
            return candidate
    return None


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """None (fresh start), "last" (this run folder's last.ckpt), or an existing checkpoint."""
    if ckpt_path is None:
        return None
    path = output_dir / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    found = existing_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no checkpoint at {path}")
    return str(found)


def auto_resume_path(output_dir: Path) -> str | None:
    """The checkpoint a requeued SLURM job resumes from without being told: the run folder's
    last.ckpt when the run was preempted (a PREEMPTED marker, written by SaveOnSignal before it
    requeued) or SLURM restarted the job (SLURM_RESTART_COUNT > 0). None: start fresh."""
    from longctx.distributed.slurm import PREEMPTED_MARKER, restart_count

    checkpoints = output_dir / "checkpoints"
    if not (checkpoints / PREEMPTED_MARKER).is_file() and restart_count() == 0:
        return None
    found = existing_checkpoint(checkpoints / "last.ckpt")
    return None if found is None else str(found)
