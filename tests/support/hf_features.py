"""Test support: PackedBatch <-> transformers, HF-style features in, a stock causal LM's forward
kwargs out (the references that longctx's own HF path and the leak probe are checked against)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, INT_DTYPES, PackedBatch


def from_features(
    features: Sequence[dict],
    seq_len: int,
    reset_position_ids: bool,
    pad_id: int = 0,
) -> PackedBatch:
    """Flatten HF-style features (``{"input_ids": [...], "labels": [...]?}``) into rows.

    The flattening-collator use case: features are laid end to end, in order, each one a
    segment; a feature that does not fit in what is left of a row starts the next row, and
    a row that is not full gets a pad tail (``pad_id``, no loss) as a segment of its own.
    Labels stay within a feature: without ``labels`` each token's target is the next token
    of its feature; with ``labels`` (HF's unshifted convention, -100 = no loss) the target
    of token i is ``labels[i + 1]``. A feature longer than ``seq_len`` is split into pieces
    of at most ``seq_len`` tokens, each its own segment (never dropped, never truncated);
    the last token of each piece has no target. Positions are continuous 0..L-1 along the
    row unless ``reset_position_ids``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}; expected a positive int")
    pieces = [
        piece
        for i, feature in enumerate(_check_features(features))
        for piece in _feature_pieces(i, feature, seq_len)
    ]
    rows = _fill_rows(pieces, seq_len)
    tokens = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    lengths = []
    for r, row in enumerate(rows):
        ids, targets = torch.cat([p[0] for p in row]), torch.cat([p[1] for p in row])
        tokens[r, : ids.numel()], labels[r, : ids.numel()] = ids, targets
        lengths.append([p[0].numel() for p in row])
    return PackedBatch.from_lengths(tokens, lengths, reset_position_ids, labels=labels)


def to_hf_kwargs(batch: PackedBatch) -> dict:
    """Keyword arguments for a stock transformers causal LM's forward.

    ``labels`` follow HF's unshifted convention (the model shifts them: target of i is
    ``labels[i + 1]``); ``shift_labels`` are the batch's own (already shifted) labels,
    which transformers' causal-LM loss uses as given, so a target at the last position is
    not lost. ``cu_seq_lens_q/k`` (int32, over the flattened B*L tokens) and
    ``max_length_q/k`` make transformers' flash-attention path run varlen per segment
    instead of guessing boundaries from position ids, so continuous positions are masked
    too. Other attention implementations (sdpa, eager) ignore them and mask documents only
    when position ids reset; pass ``use_cache=False``.
    """
    hf_labels = torch.full_like(batch.labels, IGNORE_INDEX)
    hf_labels[:, 1:] = batch.labels[:, :-1]
    cu_seqlens = batch.cu_seqlens.to(batch.tokens.device)
    return {
        "input_ids": batch.tokens,
        "position_ids": batch.position_ids,
        "labels": hf_labels,
        "shift_labels": batch.labels,
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": batch.max_seqlen,
        "max_length_k": batch.max_seqlen,
    }


def _check_features(features: Sequence[dict]) -> Sequence[dict]:
    if isinstance(features, dict) or not isinstance(features, Sequence) or not features:
        raise ValueError(
            f"features must be a non-empty list of dicts with 'input_ids'; got {type(features)}"
        )
    for i, feature in enumerate(features):
        if not isinstance(feature, dict) or "input_ids" not in feature:
            raise ValueError(f"feature {i} has no 'input_ids': {feature!r:.200}")
    return features


def _feature_pieces(index: int, feature: dict, seq_len: int) -> list[tuple[Tensor, Tensor]]:
    """(input ids, shifted targets) of one feature, split into pieces of <= seq_len tokens."""
    ids = torch.as_tensor(feature["input_ids"])
    if ids.ndim != 1 or ids.numel() == 0 or ids.dtype not in INT_DTYPES or bool((ids < 0).any()):
        raise ValueError(
            f"feature {index} input_ids must be a non-empty 1-D list of ids >= 0; "
            f"got {feature['input_ids']!r:.200}"
        )
    hf_labels = torch.as_tensor(feature.get("labels", ids)).long()
    if hf_labels.shape != ids.shape:
        raise ValueError(
            f"feature {index} has {hf_labels.numel()} labels for {ids.numel()} input_ids"
        )
    pieces = []
    for start in range(0, ids.numel(), seq_len):
        piece_labels = hf_labels[start : start + seq_len]
        targets = torch.full_like(piece_labels, IGNORE_INDEX)
        targets[:-1] = piece_labels[1:]  # the piece's last token has no target within it
        pieces.append((ids[start : start + seq_len].long(), targets))
    return pieces


def _fill_rows(pieces: list[tuple[Tensor, Tensor]], seq_len: int) -> list[list]:
    """Lay pieces end to end in order; one that does not fit starts a new row."""
    rows, used = [[]], 0
    for piece in pieces:
        if used + piece[0].numel() > seq_len:
            rows, used = rows + [[]], 0
        rows[-1].append(piece)
        used += piece[0].numel()
    return rows
