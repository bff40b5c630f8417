"""Per-position loss on long held-out documents, out to ``factor`` x the training length.

Context extension is judged past the length a model was trained at (Xiong et al. 2023 compare
perplexity on 32k-token books): here on texts no training row contains -- the embedded corpus's
held-out books (longctx.data.corpus.HELD_OUT_BOOKS), or a prepared folder named by
``data.long_documents``. Each document is attended alone from position 0 (its own segment),
cut at ``factor x seq_len`` tokens. Reported per log2 position bucket (the curve) and per
octave ending at 1x, 2x, 4x ... the training length: the octave ``[L/2, L)`` is the last one
trained on, ``[L, 2L)`` and ``[2L, 4L)`` are extrapolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.data.corpus import EMBEDDED, long_documents_dir
from longctx.data.shards import ShardSet
from longctx.data.synthesize import holds_only_training_haystacks
from longctx.errors import LongctxError
from longctx.eval.documents import document_batches, document_records, score_documents


def check_eval_length(length: int, max_seq_len: int, what: str) -> None:
    """An evaluation length RoPE is configured for (positions < model.max_seq_len)."""
    if length > max_seq_len:
        raise LongctxError(
            f"evaluation length {length} ({what}) exceeds model.max_seq_len={max_seq_len}, the "
            "largest position RoPE is configured for; raise model.max_seq_len (extending RoPE "
            "with rope_theta / rope_scaling) or evaluate shorter"
        )


def check_factor(factor: int) -> None:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise LongctxError(f"factor={factor!r}; expected an int >= 1 (a multiple of seq_len)")
    if factor & (factor - 1):
        raise LongctxError(
            f"factor={factor}; expected a power of two (the report is per octave: 1x, 2x, 4x ...)"
        )


def multiples(factor: int) -> list[int]:
    """1, 2, 4, ..., factor."""
    check_factor(factor)
    return [2**k for k in range(factor.bit_length())]


def octave_starts(seq_len: int, factor: int) -> list[int]:
    """Range starts [0, L/2, L, 2L, ..., factor L / 2]: the octaves ending at 1x ... factor x."""
    return [0] + [m * seq_len // 2 for m in multiples(factor)]


def probe_lengths(seq_len: int, factor: int) -> list[int]:
    """Passkey context lengths up to factor x seq_len: the powers of two from 1024 below it,
    and every multiple of seq_len (1x, 2x ... factor x)."""
    if seq_len < 1:
        raise LongctxError(f"seq_len={seq_len}; expected >= 1")
    longest = factor * seq_len
    powers = {1024 * 2**k for k in range(longest.bit_length()) if 1024 * 2**k < longest}
    return sorted(powers | {m * seq_len for m in multiples(factor)})


def load_long_documents(data_config) -> list[np.ndarray]:
    """The long held-out documents of a run's data config (every document of the folder)."""
    folder = data_config.long_documents
    if folder is None:
        if not held_out_books_unseen(data_config):
            raise LongctxError(
                f"data.long_documents is not set and data.shards={data_config.shards} is not "
                "the embedded corpus (whose held-out books are the default) or a mix of it with "
                "synthesized folders; expected a prepared folder of long documents that no "
                "training row contains"
            )
        folder = long_documents_dir(data_config.cache_dir, tokenizer=data_config.tokenizer)
    docs = ShardSet(Path(folder), "train")
    if docs.num_documents == 0:
        raise LongctxError(f"data.long_documents={str(folder)!r} holds no documents")
    return [docs.document(i) for i in range(docs.num_documents)]


def held_out_books_unseen(data_config) -> bool:
    """No training row holds the embedded corpus's held-out books: the sources are the embedded
    corpus and folders synthesized from its training chapters (or noise) only."""
    return data_config.shards is None or all(
        f == EMBEDDED or holds_only_training_haystacks(f) for f in data_config.shards
    )


def score_long_documents(
    model,
    docs: Sequence[np.ndarray],
    seq_len: int,
    factor: int,
    max_seq_len: int,
    pad_id: int,
    device,
    forward_context=None,
) -> dict[str, list[dict]]:
    """{"curve": per (doc, log2 bucket) records, "octaves": per (doc, octave) records} of
    ``model.token_loss`` on ``docs`` cut at factor x seq_len, one document per row;
    ``max_seq_len``: the model config's (the longest length RoPE is configured for)."""
    length = factor * seq_len
    check_eval_length(length, max_seq_len, f"{factor} x seq_len={seq_len}")
    starts = octave_starts(seq_len, factor)

    def both(token_loss, batch, rows) -> list[tuple[list[dict], list[dict]]]:
        curve = document_records(token_loss, batch, rows)
        return [(curve, document_records(token_loss, batch, rows, starts))]

    batches = document_batches(docs, length, 1, pad_id)
    scored = score_documents(model, batches, device, forward_context, both)
    return {
        "curve": [r for curve, _ in scored for r in curve],
        "octaves": [r for _, octaves in scored for r in octaves],
    }


def octave_table(records: Sequence[dict], seq_len: int, factor: int) -> list[dict]:
    """Token-weighted loss per octave ending at m x seq_len: multiple, start, end, loss, tokens."""
    starts = octave_starts(seq_len, factor)
    ends = starts[2:] + [factor * seq_len]
    rows = []
    for m, start, end in zip(multiples(factor), starts[1:], ends, strict=True):
        cell = [r for r in records if r["bucket_start"] == start]
        tokens = sum(r["tokens"] for r in cell)
        loss = sum(r["loss_sum"] for r in cell) / tokens if tokens else float("nan")
        rows.append({"multiple": m, "start": start, "end": end, "loss": loss, "tokens": tokens})
    return rows


def octave_metrics(table: Sequence[dict], prefix: str = "val/long_loss") -> dict[str, float]:
    """Flat metric names: val/long_loss/1x, /2x, /4x (octaves without tokens are left out)."""
    return {f"{prefix}/{r['multiple']}x": r["loss"] for r in table if r["tokens"]}
