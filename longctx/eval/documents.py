"""Every arm scored the same way: fixed held-out documents, each attended alone, positions from 0.

An arm's validation rows carry its own position ids and mask, so an arm trained with
cross-document attention is also validated with it, and its loss is not comparable to a masked
arm's. Here every arm sees identical inputs: the first documents of the val split, each its own
segment (document mask, positions reset), which by packed == unpacked equals running each
document alone. The per-document loss sums (by in-document position bucket) are what the paired
bootstrap of :mod:`studies.ablation` resamples: same documents in every arm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.errors import LongctxError
from longctx.eval.position_loss import bucket_of, bucket_starts


def document_batches(
    docs: Sequence[np.ndarray], seq_len: int, rows_per_batch: int, pad_id: int
) -> list[tuple[PackedBatch, list[list[int]]]]:
    """Documents laid in order into rows of seq_len (a longer one keeps its first seq_len
    tokens), each its own segment with positions from 0; a row's pad tail has no loss.
    Returns (batch, the document index of every segment of every row but the pad tail)."""
    rows, current, used = [], [], 0
    for i, doc in enumerate(docs):
        n = min(len(doc), seq_len)
        if used + n > seq_len:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        rows.append(current)
    return [
        _batch(rows[i : i + rows_per_batch], docs, seq_len, pad_id)
        for i in range(0, len(rows), rows_per_batch)
    ]


def _batch(rows: list[list[int]], docs, seq_len: int, pad_id: int):
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    lengths = []
    for r, row in enumerate(rows):
        pieces = [torch.from_numpy(np.asarray(docs[i][:seq_len], np.int64)) for i in row]
        flat = torch.cat(pieces)
        tokens[r, : flat.numel()] = flat
        lengths.append([p.numel() for p in pieces])
    batch = PackedBatch.from_lengths(tokens, lengths, reset_position_ids=True)
    labels = batch.labels.clone()
    for r, row_lengths in enumerate(lengths):
        labels[r, sum(row_lengths) :] = IGNORE_INDEX  # the pad tail predicts nothing
    return PackedBatch(batch.tokens, labels, batch.position_ids, batch.seq_lens), rows


def document_records(
    token_loss: Tensor,
    batch: PackedBatch,
    rows: list[list[int]],
    range_starts: Sequence[int] | None = None,
) -> list[dict]:
    """Loss sums and target counts per (document, in-document position bucket): the log2
    buckets, or the ranges [range_starts[i], range_starts[i + 1]) when given."""
    records = []
    scored = batch.labels != IGNORE_INDEX
    for r, docs in enumerate(rows):
        start = 0
        for doc, n in zip(docs, batch.seq_lens[r].tolist(), strict=False):
            keep = scored[r, start : start + n]
            loss = token_loss[r, start : start + n][keep].double()
            positions = batch.position_ids[r, start : start + n][keep]
            if range_starts is None:
                buckets, starts = bucket_of(positions), bucket_starts(int(n))
            else:
                starts = list(range_starts)
                buckets = torch.bucketize(positions, torch.tensor(starts), right=True) - 1
            sums = torch.bincount(buckets, weights=loss, minlength=len(starts))
            counts = torch.bincount(buckets, minlength=len(starts))
            records += [
                {"doc": doc, "bucket_start": s, "tokens": int(c), "loss_sum": float(t)}
                for s, c, t in zip(starts, counts.tolist(), sums.tolist(), strict=True)
                if c
            ]
            start += n
    return records


@torch.no_grad()
def score_documents(
    model, batches, device: torch.device, forward_context=None, records=document_records
) -> list:
    """``records(token_loss, batch, rows)`` of ``model.token_loss`` (on the CPU) over every
    batch of :func:`document_batches`, concatenated: per (document, bucket) by default."""
    out = []
    with eval_mode(model):
        for batch, rows in batches:
            with (forward_context or contextlib.nullcontext)():
                token_loss = model.token_loss(batch.to(device))
            out += records(token_loss.float().cpu(), batch, rows)
    return out


@contextlib.contextmanager
def eval_mode(model):
    """``model`` in eval mode, then back in the mode it was in (callbacks score mid-training)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def mean_loss(records: Sequence[dict]) -> float:
    """Token-weighted mean loss over records."""
    tokens = sum(r["tokens"] for r in records)
    if not tokens:
        raise LongctxError(
            "no scored tokens in the held-out documents (every document has 1 token?)"
        )
    return sum(r["loss_sum"] for r in records) / tokens
