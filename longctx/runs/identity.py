"""What a run *is*, stored in every checkpoint and compared on resume.

A run's identity is its model config and the data settings that say what its token stream is
(corpus, tokenizer, BOS, packing, sequence length, position ids, document masking, loss
targets: :data:`STREAM_DATA_KEYS`, where every data setting is decided). Resuming a
checkpoint under a different identity would silently mix two arms (a changed ``rope_theta``
loads without complaint), so a resume with differences is refused, listing them, unless each
difference is allowed explicitly (``allow_resume_changes=[key, ...]``), which is logged.

Checkpoints also carry the run's resolved model and data config: longctx.runs.record.
"""

from __future__ import annotations

import dataclasses

from longctx.errors import LongctxError
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


class ResumeMismatch(LongctxError):
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
