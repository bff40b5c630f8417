"""Resume policy: which checkpoint a start continues from, and what a fresh start may find.

- ``ckpt_path=last`` / a path / a requeued SLURM job: the checkpoint, checked readable and
  checked to be the same run (its identity; deliberate changes are allowed by name).
- A fresh start into a run folder that holds checkpoints is refused (two runs' checkpoints side by
  side, and a later ``ckpt_path=last`` could pick the older), unless ``overwrite=true``: then the
  previous run is removed whole (checkpoints, metrics, W&B files, eval outputs, its configs), so
  nothing of it is read next to the new run, and this start's config becomes the folder's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from longctx.io import atomic_write_bytes
from longctx.runs.checkpoints import (
    ResumePoint,
    UnreadableCheckpoint,
    auto_resume_path,
    resolve_ckpt_path,
)
from longctx.runs.folder import HYDRA_DIR, LOCK_FILE, checkpoint_dir, existing_checkpoints
from longctx.runs.identity import ResumeMismatch, check_resume
from longctx.runs.record import CHECKPOINT_KEY


class ResumeRefused(ValueError):
    """This start cannot resume, or cannot start fresh, in this run folder."""


def resume_point(
    ckpt_path: str | None,
    output_dir: Path,
    identity: dict,
    allowed_changes: list[str],
) -> ResumePoint | None:
    """The checkpoint this start resumes from, or None for a fresh start."""
    try:
        resume = resolve_ckpt_path(ckpt_path, output_dir)
        if resume is None and (resume := auto_resume_path(output_dir)):
            print("resuming a preempted / requeued run", flush=True)
    except (FileNotFoundError, UnreadableCheckpoint) as err:
        raise ResumeRefused(f"ckpt_path={ckpt_path}: {err}") from err
    if resume is None:
        return None
    try:
        allowed = check_resume(resume.contents, identity, allowed_changes, resume.path)
    except ResumeMismatch as err:
        raise ResumeRefused(str(err)) from err
    if CHECKPOINT_KEY not in resume.contents:
        print(f"{resume.path} stores no run identity (an older checkpoint): not checked")
    for key, (old, new) in allowed.items():
        print(f"resuming with a change allowed by allow_resume_changes: {key}: {old!r} -> {new!r}")
    return resume


def check_fresh_start(output_dir: Path, overwrite: bool, config_dir: Path | None) -> None:
    """Refuse a fresh start among another run's checkpoints; with ``overwrite`` remove that run
    (see the module docstring). ``config_dir``: where Hydra wrote this start's config."""
    found = existing_checkpoints(checkpoint_dir(output_dir))
    if found and not overwrite:
        raise ResumeRefused(
            f"run folder {output_dir} already has checkpoints ({', '.join(found)}): resume it "
            "with ckpt_path=last, pick another run_name, or start it over with overwrite=true "
            "(the previous run's files are deleted)"
        )
    if overwrite:
        removed = remove_previous_run(output_dir, config_dir)
        if removed:
            print(f"overwrite=true: deleted the previous run's {', '.join(removed)} from "
                  f"{output_dir}", flush=True)  # fmt: skip


def remove_previous_run(output_dir: Path, config_dir: Path | None) -> list[str]:
    """Delete everything in ``output_dir`` but the lock and Hydra's job log (this process is
    writing it); this start's config files (in ``config_dir``) are written back to ``.hydra/``.
    Returns the names deleted."""
    this_start = {}
    if config_dir is not None and Path(config_dir).is_dir():
        this_start = {f.name: f.read_bytes() for f in Path(config_dir).iterdir() if f.is_file()}
    removed = []
    for entry in sorted(output_dir.iterdir()):
        if entry.name == LOCK_FILE or entry.suffix == ".log":
            continue
        removed.append(entry.name + ("/" if entry.is_dir() else ""))
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if this_start:
        (output_dir / HYDRA_DIR).mkdir()
    for name, data in this_start.items():
        atomic_write_bytes(output_dir / HYDRA_DIR / name, data)
    return removed
