"""Resume policy: which checkpoint a start continues from, what a resume may change, and what a
fresh start may find.

- The checkpoint (``ckpt_path=last``, a path, a requeued SLURM job) is checked readable and to
  be the same run (longctx.runs.identity) trained the same way.
- What a resume may change: :data:`APPLIED_ON_RESUME` applied and said, :data:`FIXED_ON_RESUME`
  never (the checkpoint's optimizer and schedule state belong to those classes), any other
  optimizer or schedule setting only when ``allow_resume_changes`` lists it (docs/reliability.md,
  "What a resume may change").
- A fresh start into a run folder that holds checkpoints is refused (a later ``ckpt_path=last``
  could pick the older run's), unless ``overwrite=true`` (longctx.runs.folder.RunStart).
"""

from __future__ import annotations

from pathlib import Path

from longctx.errors import LongctxError
from longctx.runs.checkpoints import (
    ResumePoint,
    UnreadableCheckpoint,
    auto_resume_path,
    resolve_ckpt_path,
)
from longctx.runs.folder import RunStart, checkpoint_dir, existing_checkpoints
from longctx.runs.identity import check_allowed_names, check_resume, identity_changes
from longctx.runs.record import CHECKPOINT_KEY, plain

# where the run record keeps the training settings (next to the model and data config)
TRAINING_KEY = "training"
# a resume applies these as configured and says so: the lr schedule's length, the stop policy
APPLIED_ON_RESUME = ("trainer.max_steps", "optim.skip_nonfinite")
# a resume never changes these: the checkpoint's optimizer / schedule state is theirs (AdamW's
# amsgrad keeps one more moment per parameter, which a checkpoint without it lacks)
FIXED_ON_RESUME = (
    "optim.optimizer._target_",
    "optim.scheduler._target_",
    "optim.optimizer.amsgrad",
)
# not compared: the elastic resume keeps the checkpoint's global batch (and says so)
NOT_COMPARED = ("optim.accumulate_grad_batches", "optim.allow_global_batch_change")


class ResumeRefused(LongctxError):
    """This start cannot resume, or cannot start fresh, in this run folder."""


def training_settings(optim: dict, max_steps: int | None) -> dict:
    """Flat ``{"optim.optimizer.lr": 3e-3, ..., "trainer.max_steps": 100}`` from the resolved
    ``optim`` group: what a resume compares with its checkpoint's (Hydra's ``_partial_`` left
    out: how a factory is called, not a setting)."""
    flat = {"trainer.max_steps": max_steps}
    stack = [("optim", optim)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}.{key}", value))
            elif key != "_partial_" and f"{prefix}.{key}" not in NOT_COMPARED:
                flat[f"{prefix}.{key}"] = value
    return plain(dict(sorted(flat.items())))


def resume_point(
    ckpt_path: str | None,
    output_dir: Path,
    identity: dict,
    allowed_changes: list[str],
    training: dict,
) -> ResumePoint | None:
    """The checkpoint this start resumes from (checked, see the module docstring), or None for
    a fresh start. ``training``: this start's :func:`training_settings`. Raises ResumeRefused,
    or ResumeMismatch for a change of the run or an unknown name in ``allowed_changes``."""
    check_allowed_names(allowed_changes, set(identity) | set(training))
    try:
        resume = resolve_ckpt_path(ckpt_path, output_dir)
        if resume is None and (resume := auto_resume_path(output_dir)):
            print("resuming a preempted / requeued run", flush=True)
    except (FileNotFoundError, UnreadableCheckpoint) as err:
        raise ResumeRefused(f"ckpt_path={ckpt_path}: {err}") from err
    if resume is None:
        return None
    allowed = check_resume(resume.contents, identity, allowed_changes, resume.path)
    if CHECKPOINT_KEY not in resume.contents:
        print(f"{resume.path} stores no run identity (an older checkpoint): not checked")
    for key, (old, new) in allowed.items():
        print(f"resuming with a change allowed by allow_resume_changes: {key}: {old!r} -> {new!r}")
    check_training_changes(resume, training, allowed_changes)
    return resume


def check_training_changes(resume: ResumePoint, training: dict, allowed: list[str]) -> None:
    """Refuse, apply or allow each changed training setting (see the module docstring)."""
    record = resume.contents.get(CHECKPOINT_KEY) or {}
    saved = (record.get("config") or {}).get(TRAINING_KEY)
    if saved is None:
        print(f"{resume.path} stores no training settings (an older checkpoint): the configured "
              "optimizer and schedule settings replace its own", flush=True)  # fmt: skip
        return
    changes = identity_changes(saved, training)
    for key, (old, new) in changes.items():
        what = f"{key}: {old!r} (checkpoint) -> {new!r} (now)"
        if key in FIXED_ON_RESUME:
            raise ResumeRefused(
                f"resuming {resume.path} would change {what}; a resume cannot (the checkpoint's "
                "optimizer and lr-schedule state are made for it): resume with the "
                "checkpoint's, or start a new stage from its weights with model.init_from"
            )
        if key not in APPLIED_ON_RESUME and key not in allowed:
            raise ResumeRefused(
                f"resuming {resume.path} would change {what}; resume with the checkpoint's "
                f"value, or apply the change with allow_resume_changes=[{key}]"
            )
    for key, (old, new) in changes.items():
        how = "allowed by allow_resume_changes" if key in allowed else "applied as configured"
        print(f"resuming with a change {how}: {key}: {old!r} -> {new!r}", flush=True)


def check_fresh_start(output_dir: Path, overwrite: bool, start: RunStart | None) -> None:
    """Refuse a fresh start among another run's checkpoints; with ``overwrite`` remove that run
    (see the module docstring). ``start``: this start's view of the folder (None: a rank that
    does not write it)."""
    found = existing_checkpoints(checkpoint_dir(output_dir))
    if found and not overwrite:
        raise ResumeRefused(
            f"run folder {output_dir} already has checkpoints ({', '.join(found)}): resume it "
            "with ckpt_path=last, pick another run_name, or start it over with overwrite=true "
            "(the previous run's files are deleted)"
        )
    if overwrite and start is not None:
        removed = start.start_over()
        if removed:
            print(f"overwrite=true: deleted the previous run's {', '.join(removed)} from "
                  f"{output_dir}", flush=True)  # fmt: skip
