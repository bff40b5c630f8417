"""Resume policy: which checkpoint a start continues from, what a resume may change, and what a
fresh start may find.

A run's identity is its model config and the data settings that say what its token stream is
(corpus, tokenizer, BOS, packing, sequence length, position ids, document masking, loss
targets: :data:`STREAM_DATA_KEYS`, where every data setting is decided), stored in every
checkpoint with the run's resolved config (longctx.runs.record). Resuming a checkpoint under a
different identity would silently mix two arms (a changed ``rope_theta`` loads without
complaint), so a resume with differences is refused, listing them, unless each difference is
allowed explicitly (``allow_resume_changes=[key, ...]``), which is logged.

- The checkpoint (``ckpt_path=last``, a path, a requeued SLURM job) is checked readable and to
  be the same run trained the same way.
- What a resume may change: :data:`APPLIED_ON_RESUME` applied and said, :data:`FIXED_ON_RESUME`
  never (the checkpoint's optimizer and schedule state belong to those classes), any other
  optimizer or schedule setting only when ``allow_resume_changes`` lists it (docs/reliability.md,
  "What a resume may change").
- A fresh start into a run folder that holds checkpoints is refused (a later ``ckpt_path=last``
  could pick the older run's), unless ``overwrite=true`` (longctx.runs.folder.RunStart).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from longctx.errors import LongctxError
from longctx.runs.checkpoints import (
    ResumePoint,
    UnreadableCheckpoint,
    auto_resume_path,
    resolve_ckpt_path,
)
from longctx.runs.folder import RunStart, checkpoint_dir, existing_checkpoints
from longctx.runs.record import CHECKPOINT_KEY, plain

# Every DataConfig field, by what a resume does with it: each is in exactly one of these three
# lists (tests/e2e/test_resume_changes.py holds it, so a new field is decided, not forgotten).
#
# What the token stream is (which ids, in which rows, with which positions, attention and loss
# targets): the run's identity, so a change is refused by name unless allow_resume_changes
# lists it. Compared as configured: add_bos null -> true is a change even where the tokenizer's
# convention already put a BOS first.
STREAM_DATA_KEYS = (
    "shards",  # the corpus (a prepared folder's content: also the data stream's input hashes)
    "weights",  # the mix of its sources
    "tokenizer",  # the ids of every document
    "add_bos",  # a BOS id before every document (a resume once switched it on, unsaid)
    "seq_len",  # the row length
    "packer",  # which documents share a row
    "reset_position_ids",  # the position ids
    "document_mask",  # attention across documents
    "loss_tokens",  # which targets the loss counts
)
# Where the stream stands, and the order of its rows: the data stream resumes at the
# checkpoint's row only when these are unchanged, and refuses naming the one that is not
# (longctx.data.datamodule, the fingerprint its state holds).
ORDER_DATA_KEYS = (
    "seed",
    "micro_batch_size",
    "buffer_size",  # best_fit's buffer: which documents are packed together
    "num_streams",
    "num_workers",  # only through num_streams=null (the fingerprint holds the streams used)
    "chunk_documents",
    "stages",
    "length_upsampling",
    "dp_balance",  # which rank and micro-batch of a step trains each row
)
# Not the training stream: how it is loaded, where caches are, what validation and the
# long-document loss read (they report, they do not train), and what the data module derives
# from the keys above. A resume uses them as configured.
OTHER_DATA_KEYS = (
    "pin_memory",
    "cache_dir",
    "val_rows",
    "long_documents",
    "bos_id",  # from add_bos and the tokenizer
    "answer_keys",  # from loss_tokens and the corpus
)
# the keys that joined the identity after checkpoints first carried one (2026-12-05): a checkpoint
# without them is older, not different
LATER_IDENTITY_KEYS = ("data.tokenizer", "data.add_bos", "data.loss_tokens")
# how the model runs or where its first weights came from, not which function it computes
RUNTIME_MODEL_KEYS = ("attn_backend", "activation_checkpointing", "loss_chunk_size", "init_from")


class ResumeRefused(LongctxError):
    """This start cannot resume, or cannot start fresh, in this run folder."""


class ResumeMismatch(ResumeRefused):
    """A resume that would change the run's identity without being allowed to."""


def run_identity(model_config, data_config) -> dict:
    """Flat ``{"model.rope_theta": ..., "data.document_mask": ...}`` of plain values."""
    if dataclasses.is_dataclass(model_config):
        model = dataclasses.asdict(model_config)
    else:  # a model factory (model=hf) is identified by its description
        model = {"spec": repr(model_config)}
    identity = {f"model.{k}": v for k, v in model.items() if k not in RUNTIME_MODEL_KEYS}
    identity |= {f"data.{k}": getattr(data_config, k) for k in STREAM_DATA_KEYS}
    return plain(identity)


def identity_changes(saved: dict, current: dict) -> dict[str, tuple]:
    """{key: (value in the checkpoint, value now)} for every key that differs."""
    absent = "<absent>"
    keys = sorted(saved.keys() | current.keys())
    return {
        k: (saved.get(k, absent), current.get(k, absent))
        for k in keys
        if saved.get(k, absent) != current.get(k, absent)
    }


def check_allowed_names(allowed: list[str], known: set[str]) -> None:
    """Every name ``allow_resume_changes`` lists is one of the run's settings (checked on a
    fresh start too: a misspelt name would otherwise wait for the resume it was meant for)."""
    unknown = [k for k in allowed if k not in known]
    if unknown:
        raise ResumeMismatch(
            f"allow_resume_changes={allowed}: {unknown} not among the run's settings "
            f"({', '.join(sorted(known))})"
        )


def check_resume(
    checkpoint: dict, current: dict, allowed: list[str], path: str
) -> dict[str, tuple]:
    """Refuse a resume that changes the run unless every change is in ``allowed`` (its names
    checked by :func:`check_allowed_names` first); returns the allowed changes (for the log)."""
    saved = (checkpoint.get(CHECKPOINT_KEY) or {}).get("identity")
    if saved is None:
        return {}  # written before checkpoints carried an identity: nothing to compare
    if unrecorded := sorted((current.keys() - saved.keys()) & set(LATER_IDENTITY_KEYS)):
        # a setting added to the identity since the checkpoint was written: no value to compare
        # (any other key it lacks is a change: an identity is not trusted for what it omits)
        print(f"{path} does not record {', '.join(unrecorded)} (an older checkpoint): not checked")
        current = {k: v for k, v in current.items() if k not in unrecorded}
    changes = identity_changes(saved, current)
    refused = {k: v for k, v in changes.items() if k not in allowed}
    if refused:
        lines = "\n".join(
            f"  {k}: {old!r} (checkpoint) -> {new!r} (now)" for k, (old, new) in refused.items()
        )
        raise ResumeMismatch(
            f"resuming {path} would change the run (mixing ablation arms or models):\n{lines}\n"
            "Resume with the checkpoint's settings, or allow a deliberate change with "
            f"allow_resume_changes=[{','.join(refused)}]"
        )
    return changes


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
    a fresh start. ``training``: this start's :func:`training_settings`. Raises
    ResumeRefused (ResumeMismatch: a change of the run, or an unknown name in allowed_changes)."""
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


def check_fresh_start(output_dir: Path, overwrite: bool, start: RunStart) -> None:
    """Refuse a fresh start among another run's checkpoints; with ``overwrite`` remove that run
    (see the module docstring). ``start``: this start's view of the folder."""
    found = existing_checkpoints(checkpoint_dir(output_dir))
    if found and not overwrite:
        raise ResumeRefused(
            f"run folder {output_dir} already has checkpoints ({', '.join(found)}): resume it "
            "with ckpt_path=last, pick another run_name, or start it over with overwrite=true "
            "(the previous run's files are deleted)"
        )
    if overwrite:
        removed = start.start_over()
        if removed:
            print(f"overwrite=true: deleted the previous run's {', '.join(removed)} from "
                  f"{output_dir}", flush=True)  # fmt: skip
