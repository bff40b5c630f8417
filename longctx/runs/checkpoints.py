"""Checkpoints are written atomically: a crash mid-write never leaves a file a resume would trust."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from longctx.distributed.sharded import UnreadableShardedCheckpoint, read_dcp_metadata
from longctx.distributed.slurm import PREEMPTED_MARKER, restart_count
from longctx.errors import LongctxError
from longctx.io import atomic_file
from longctx.runs.folder import checkpoint_dir, existing_checkpoints, last_checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(Path(path)) as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path, *args, **kwargs) -> dict:
        """A single-file checkpoint; a sharded folder only FSDP2Strategy reads (it does not
        call this), so on another strategy it is refused in one line."""
        if Path(path).is_dir():
            raise LongctxError(
                f"ckpt_path={path} is a sharded checkpoint folder (written by trainer=fsdp), "
                "which this trainer cannot load; resume it with trainer=fsdp (any number of "
                "devices), or start a new stage from its weights with model.init_from="
                f"{path}"
            )
        return super().load_checkpoint(path, *args, **kwargs)


def existing_checkpoint(path: Path) -> Path | None:
    """``path`` (a file, or a sharded FSDP folder), else the ``.old`` copy an interrupted
    folder swap leaves (longctx.distributed.fsdp.swap_into_place), else None."""
    for candidate in (path, path.with_name(path.name + ".old")):
        if candidate.is_file() or (candidate.is_dir() and any(candidate.iterdir())):
            return candidate
    return None


class UnreadableCheckpoint(LongctxError):
    """A checkpoint file that is empty, truncated, or not a safe (weights-only) checkpoint."""


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint's contents, memory-mapped (tensors are not read) and weights-only: a
    checkpoint is data, and a crafted pickle in one must never run code. A sharded (FSDP)
    checkpoint folder gives its ``meta.pt``: everything but the tensors; its index is checked
    to be plain distributed-checkpoint metadata first (longctx.distributed.sharded)."""
    path = Path(path)
    if path.is_dir():
        try:
            read_dcp_metadata(path)  # an UnsafeShardedCheckpoint (a LongctxError) passes through
        except UnreadableShardedCheckpoint as err:
            raise UnreadableCheckpoint(str(err)) from err
    file = path / "meta.pt" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint at {file}")
    if file.stat().st_size == 0:
        raise UnreadableCheckpoint(f"checkpoint {file} is empty (0 bytes)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # truncated zip, refused pickle, ...: all name the file
        raise UnreadableCheckpoint(
            f"checkpoint {file} cannot be read as a weights-only checkpoint "
            f"({type(err).__name__}: {str(err).splitlines()[0][:300]})"
        ) from err


@dataclass
class ResumePoint:
    """A checkpoint to resume from, checked readable, and what it holds (tensors mapped)."""

    path: str
    contents: dict
    note: str  # what was chosen and why, for the log

    @property
    def step(self) -> int:
        return int(self.contents.get("global_step", 0))

    def announce(self) -> str:
        """Say what is resumed (for the log); the path to hand to Lightning."""
        print(f"{self.note} at step {self.step}", flush=True)
        return self.path


def resolve_ckpt_path(ckpt_path: str | None, output_dir: Path) -> ResumePoint | None:
    """None (fresh start); "last": this run folder's last.ckpt, or, when that one cannot be
    read, the newest readable checkpoint next to it (said in ``note``); or a given checkpoint,
    which must be readable."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        found = existing_checkpoint(Path(ckpt_path))
        if found is None:
            raise FileNotFoundError(f"ckpt_path={ckpt_path}: no checkpoint at {ckpt_path}")
        return ResumePoint(str(found), read_checkpoint(found), f"resuming from {found}")
    last, folder = last_checkpoint(output_dir), checkpoint_dir(output_dir)
    found = existing_checkpoint(last)
    # last.ckpt first, then every other checkpoint in the folder, newest first
    others = [folder / name for name in existing_checkpoints(folder) if folder / name != found]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    candidates = ([found] if found is not None else []) + others
    if not candidates:
        raise FileNotFoundError(f"ckpt_path=last: no checkpoint at {last}")
    problems = []
    for candidate in candidates:
        try:
            contents = read_checkpoint(candidate)
        except UnreadableCheckpoint as err:
            problems.append(str(err))
            continue
        note = f"resuming from {candidate}"
        if problems:
            note = f"{'; '.join(problems)}; falling back to the previous good checkpoint: {note}"
        return ResumePoint(str(candidate), contents, note)
    raise UnreadableCheckpoint(f"ckpt_path=last: no readable checkpoint: {'; '.join(problems)}")


def remove_stale_temp_files(checkpoint_dir: Path) -> list[Path]:
    """Delete the temp files of checkpoint writes that died mid-way (kill -9, node loss).
    Only the holder of the run folder's lock may call this: no one else is writing."""
    stale = sorted(checkpoint_dir.glob(".*.tmp")) if checkpoint_dir.is_dir() else []
    for path in stale:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return stale


def auto_resume_path(output_dir: Path) -> ResumePoint | None:
    """The checkpoint a requeued SLURM job resumes from without being told: the run folder's
    last.ckpt when the run was preempted (a PREEMPTED marker, written by SaveOnSignal before it
    requeued) or SLURM restarted the job (SLURM_RESTART_COUNT > 0). None: start fresh."""
    if not (checkpoint_dir(output_dir) / PREEMPTED_MARKER).is_file() and restart_count() == 0:
        return None
    return (
        resolve_ckpt_path("last", output_dir)
        if existing_checkpoint(last_checkpoint(output_dir))
        else None
    )
