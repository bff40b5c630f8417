"""Known packing bugs, injected on purpose to prove the probe catches them (its tests only).

``LONGCTX_PROBE_INJECT=<bug>`` makes the probe hand the model broken batches, the way each bug
broke a real stack; nothing else in longctx reads it. Model-side bugs change what the run's
shard function returns; data-side bugs change the rows' labels.

- ``causal_row``: attention is causal over the whole row, the document mask dropped (accelerate's
  context parallelism forcing ``is_causal``, trl #6843).
- ``drop_cp_boundaries``: under context parallelism, each shard loses its document boundaries
  (``cu_seqlens`` dropped, axolotl #3608).
- ``reset_at_chunk_edges``: under context parallelism, position ids restart at every chunk edge
  (THD RoPE positions computed per rank, Megatron-LM #5243).
- ``pad_loss``: the pad tail has targets (pad predicting pad).
- ``crossing_targets``: a document's last token predicts the next document's first token.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard
from longctx.errors import LongctxError
from longctx.probe.checks import ProbeRows

ENV = "LONGCTX_PROBE_INJECT"
MODEL_BUGS = ("causal_row", "drop_cp_boundaries", "reset_at_chunk_edges")
DATA_BUGS = ("pad_loss", "crossing_targets")
BUGS = MODEL_BUGS + DATA_BUGS

Shard = Callable[[PackedBatch], PackedBatch]


def injected() -> str | None:
    """The bug named by LONGCTX_PROBE_INJECT, or None."""
    name = os.environ.get(ENV) or None
    if name is not None and name not in BUGS:
        raise LongctxError(f"{ENV}={name!r}; expected one of {', '.join(BUGS)}")
    return name


def shard_with_bug(shard: Shard, bug: str | None) -> Shard:
    """``shard`` followed by a model-side bug (unchanged for None or a data-side bug)."""
    if bug not in MODEL_BUGS:
        return shard
    broken = {
        "causal_row": one_segment,
        "drop_cp_boundaries": lambda b: one_segment(b) if isinstance(b, ContextShard) else b,
        "reset_at_chunk_edges": restart_at_chunk_edges,
    }[bug]
    return lambda batch: broken(shard(batch))


def rows_with_bug(rows: list[ProbeRows], bug: str | None) -> list[ProbeRows]:
    """The rows with a data-side bug in their labels (unchanged otherwise)."""
    if bug not in DATA_BUGS:
        return rows
    return [_broken_labels(r, bug) for r in rows]


def one_segment(batch: PackedBatch) -> PackedBatch:
    """Every row one segment: attention causal over the whole row."""
    b, row_len = batch.shape[0], batch.row_len
    device = batch.seq_lens.device
    whole = torch.full((b, 1), row_len, dtype=torch.int32, device=device)
    if not isinstance(batch, ContextShard):
        return PackedBatch(batch.tokens, batch.labels, batch.position_ids, whole)
    runs = [_runs(row) for row in batch.global_index.tolist()]
    width = max(len(r) for r in runs)
    pieces = torch.zeros((b, width), dtype=torch.int32, device=device)
    prefixes = torch.zeros((b, width), dtype=torch.int32, device=device)
    for i, row in enumerate(runs):
        for j, (_, length, start) in enumerate(row):
            pieces[i, j], prefixes[i, j] = length, start  # the row so far precedes the piece
    return dataclasses.replace(batch, seq_lens=pieces, key_prefix_lens=prefixes, row_seq_lens=whole)


def restart_at_chunk_edges(batch: PackedBatch) -> PackedBatch:
    """Position ids restart at 0 at every edge of the rank's share (each run of consecutive
    row positions), for the positions that continue from the run's first token (a document
    crossing the edge, or the whole run when positions are continuous)."""
    if not isinstance(batch, ContextShard):
        return batch
    positions = batch.position_ids.clone()
    for i, row in enumerate(batch.global_index.tolist()):
        for lo, length, _ in _runs(row):
            run = positions[i, lo : lo + length]
            steps = torch.arange(length, device=positions.device)
            continues = ((run - run[:1]) == steps).long().cumprod(0).bool()
            run -= run[:1] * continues
    return dataclasses.replace(batch, position_ids=positions)


def _runs(global_index: list[int]) -> list[tuple[int, int, int]]:
    """(local start, length, row position of the start) of each run of consecutive row
    positions in a rank's share of a row."""
    runs, lo = [], 0
    for j in range(1, len(global_index) + 1):
        if j == len(global_index) or global_index[j] != global_index[j - 1] + 1:
            runs.append((lo, j - lo, global_index[lo]))
            lo = j
    return runs


def _broken_labels(rows: ProbeRows, bug: str) -> ProbeRows:
    batch = rows.batch
    labels = batch.labels.clone()
    length = batch.shape[1]
    for r in range(batch.shape[0]):
        if bug == "pad_loss" and rows.pad_tokens[r]:
            labels[r, length - rows.pad_tokens[r] :] = batch.tokens[r, -1]
        for _, end in rows.segments(r)[:-1] if bug == "crossing_targets" else []:
            labels[r, end - 1] = batch.tokens[r, end]
    broken = PackedBatch(batch.tokens, labels, batch.position_ids, batch.seq_lens)
    return dataclasses.replace(rows, batch=broken)
