"""PackedBatch: the one contract between data, model and trainer.

A packed batch is B rows of L tokens. Each row is cut into segments (documents, document
fragments, or a pad tail) by ``seq_lens``; attention never crosses a segment boundary and
no label crosses one either. Position ids are an independent choice: reset at every segment,
or continuous 0..L-1 along the row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from longctx.errors import LongctxError

IGNORE_INDEX = -100
# to_dense_mask() builds a [B, L, L] bool tensor: 64 MiB per row at 8192, 16 GiB at 131072.
DENSE_MASK_MAX_LEN = 8192

# unsigned too: token shards are uint16/uint32 on disk, and torch.from_numpy keeps that dtype
INT_DTYPES = (
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)


@dataclasses.dataclass
class PackedBatch:
    """Tokens, shifted labels, position ids and per-row segment lengths.

    tokens        [B, L] int64  input ids
    labels        [B, L] int64  labels[b, i] is the target for position i; -100 = no loss
    position_ids  [B, L] int64  reset per segment, or continuous 0..L-1
    seq_lens      [B, S] int32  per-row segment lengths, zero padded; each row sums to L
    """

    tokens: Tensor
    labels: Tensor
    position_ids: Tensor
    seq_lens: Tensor

    def __post_init__(self) -> None:
        _check_tokens("tokens", self.tokens)
        b, length = self.tokens.shape
        for name in ("labels", "position_ids"):
            _check_tensor(name, getattr(self, name), ndim=2)
            if getattr(self, name).shape != self.tokens.shape:
                raise LongctxError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, "
                    f"expected the shape of tokens {(b, length)}"
                )
        _check_tensor("seq_lens", self.seq_lens, ndim=2)
        if self.seq_lens.shape[0] != b:
            raise LongctxError(f"seq_lens has {self.seq_lens.shape[0]} rows, tokens has {b}")
        if length == 0:
            raise LongctxError("tokens has an empty row (L = 0); expected L >= 1")
        if self.seq_lens.device.type == "cpu":  # value checks sync; batches are built on CPU
            _check_seq_lens(self.seq_lens, length)

    @classmethod
    def from_lengths(
        cls,
        tokens: Tensor,
        seq_lens: Tensor | Sequence[Sequence[int]],
        reset_position_ids: bool,
        labels: Tensor | None = None,
    ) -> PackedBatch:
        """Build from per-row segment lengths (the ``attention_mask_in_length`` format).

        A row whose lengths sum to less than L gets one final segment for the rest, so
        ``[[2, 3], [3, 2], [6, 0]]`` with L = 6 means ``[[2, 3, 1], [3, 2, 1], [6, 0, 0]]``.
        Without ``labels``, each token's target is the next token of its own segment and
        the last token of every segment has none.
        """
        tokens = torch.as_tensor(tokens)
        _check_tokens("tokens", tokens)
        tokens = tokens.long()
        seq_lens = _with_remainder_segment(_as_lengths_tensor(seq_lens), tokens.shape)
        if labels is None:
            labels = labels_within_segments(tokens, seq_lens)
        positions = position_ids_for(seq_lens, tokens.shape[1], reset_position_ids)
        return cls(tokens.long(), torch.as_tensor(labels).long(), positions, seq_lens)

    @classmethod
    def from_eos(cls, token_stream: Tensor, eos_id: int, reset_position_ids: bool) -> PackedBatch:
        """Build from rows of L+1 stream tokens where every document ends with ``eos_id``.

        Inputs are ``stream[:, :-1]``, labels ``stream[:, 1:]``; a document ends at its EOS
        (inclusive) and the last segment of a row may be a fragment without one. An EOS never
        predicts the next document's first token: its label is -100.
        """
        if isinstance(eos_id, bool) or not isinstance(eos_id, int | np.integer):
            raise LongctxError(f"eos_id={eos_id!r}; expected the int id of the EOS token")
        stream = torch.as_tensor(token_stream)
        _check_tokens("token_stream", stream)
        if stream.shape[1] < 2:
            raise LongctxError(
                f"token_stream has rows of {stream.shape[1]} tokens, expected L+1 >= 2"
            )
        tokens, labels = stream[:, :-1].long(), stream[:, 1:].long().clone()
        is_eos = tokens == eos_id
        labels[is_eos] = IGNORE_INDEX
        seq_lens = _lengths_from_ends(is_eos)
        positions = position_ids_for(seq_lens, tokens.shape[1], reset_position_ids)
        return cls(tokens, labels, positions, seq_lens)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def row_len(self) -> int:
        """Tokens per whole row: L here; a ContextShard holds a part of each row."""
        return self.shape[1]

    @cached_property
    def cu_seqlens(self) -> Tensor:
        """int32 [num_segments + 1] cumulative lengths over the flattened B*L tokens."""
        lens = self.seq_lens.flatten()
        lens = lens[lens > 0].to(torch.int32)
        return torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))

    @cached_property
    def max_seqlen(self) -> int:
        return int(self.seq_lens.max())

    @cached_property
    def num_segments(self) -> int:
        return int((self.seq_lens > 0).sum())

    @cached_property
    def doc_ids(self) -> Tensor:
        """int64 [B, L]: the index of each token's segment within its row."""
        b, s = self.seq_lens.shape
        ids = torch.arange(s, device=self.seq_lens.device).repeat(b)
        return ids.repeat_interleave(self.seq_lens.flatten().long()).view(self.shape)

    @cached_property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to_dense_mask(self) -> Tensor:
        """bool [B, L, L], True where query i may attend to key j (the test reference)."""
        length = self.shape[1]
        check_dense_mask_len(length, "to_dense_mask()")
        same_doc = self.doc_ids[:, :, None] == self.doc_ids[:, None, :]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.tokens.device).tril()
        return same_doc & causal

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        return self._map(Tensor.pin_memory)

    def _map(self, fn) -> PackedBatch:
        """Apply fn to every tensor, keeping already-derived values (no recomputation)."""
        out = object.__new__(type(self))  # skip re-validation: the values are unchanged
        out.__dict__.update(
            {k: fn(v) if isinstance(v, Tensor) else v for k, v in self.__dict__.items()}
        )
        return out


def check_dense_mask_len(length: int, who: str) -> None:
    """The one length limit of dense [B, L, L] masks and scores (quadratic in memory)."""
    if length > DENSE_MASK_MAX_LEN:
        raise LongctxError(
            f"{who} refuses L={length} > {DENSE_MASK_MAX_LEN}: a dense [B, L, L] mask or score "
            "tensor is quadratic in memory; use 'sdpa' on CPU, 'flex' or 'flash' on GPU"
        )


def position_ids_for(seq_lens: Tensor, length: int, reset_position_ids: bool) -> Tensor:
    """int64 [B, L] position ids: restart at each segment, or 0..L-1 along the row."""
    b = seq_lens.shape[0]
    row = torch.arange(length, device=seq_lens.device)
    if not reset_position_ids:
        return row.expand(b, length).clone()
    lens = seq_lens.flatten().long()
    starts = lens.cumsum(0) - lens  # flat start of every segment (zero-length ones included)
    return (
        torch.arange(b * length, device=seq_lens.device)
        .sub(starts.repeat_interleave(lens))
        .view(b, length)
    )


def labels_within_segments(tokens: Tensor, seq_lens: Tensor) -> Tensor:
    """Next-token labels that never cross a segment end: each segment's last token gets -100."""
    labels = torch.full_like(tokens, IGNORE_INDEX, dtype=torch.long)
    labels[:, :-1] = tokens[:, 1:]
    ends = seq_lens.long().cumsum(1) - 1  # index of each segment's last token
    rows = torch.arange(tokens.shape[0]).unsqueeze(1).expand_as(ends)
    valid = seq_lens > 0
    labels[rows[valid], ends[valid]] = IGNORE_INDEX
    return labels


def _lengths_from_ends(is_end: Tensor) -> Tensor:
    """int32 [B, S] segment lengths where segments end at True (inclusive) or the row end."""
    b, length = is_end.shape
    ends = is_end.clone()
    ends[:, -1] = True
    counts = ends.sum(1)
    end_pos = ends.nonzero()[:, 1]  # row-major, so grouped by row in order
    out = torch.zeros(b, int(counts.max()), dtype=torch.int32)
    col = torch.arange(end_pos.numel()) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    row = torch.arange(b).repeat_interleave(counts)
    prev_end = torch.where(col > 0, end_pos.roll(1), -1)
    out[row, col] = (end_pos - prev_end).to(torch.int32)
    return out


def _as_lengths_tensor(seq_lens: Tensor | np.ndarray | Sequence[Sequence[int]]) -> Tensor:
    if isinstance(seq_lens, Tensor | np.ndarray):
        return torch.as_tensor(seq_lens)
    rows = [[int(v) if isinstance(v, np.integer) else v for v in r] for r in seq_lens]
    for i, row in enumerate(rows):
        bad = [v for v in row if isinstance(v, bool) or not isinstance(v, int)]
        if bad:
            raise LongctxError(f"seq_lens row {i} has non-integer lengths {bad}: {row}")
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64).view(
        len(rows), width
    )


def _with_remainder_segment(seq_lens: Tensor, tokens_shape: torch.Size) -> Tensor:
    """Give every row one final segment for what its lengths leave of L; int32, zero padded."""
    b, length = tokens_shape
    _check_tensor("seq_lens", seq_lens, ndim=2)
    if seq_lens.shape[0] != b:
        raise LongctxError(f"seq_lens has {seq_lens.shape[0]} rows, tokens has {b}")
    rows = []
    for i, row in enumerate(seq_lens.tolist()):
        kept = [v for v in row if v != 0]
        if any(v < 0 for v in row):
            raise LongctxError(f"seq_lens row {i} has negative lengths: {row}")
        if row[: len(kept)] != kept:
            raise LongctxError(f"seq_lens row {i} has a zero before a positive length: {row}")
        if not kept:
            raise LongctxError(f"seq_lens row {i} is empty (no positive length): {row}")
        if sum(kept) > length:
            raise LongctxError(f"seq_lens row {i} sums to {sum(kept)} > L={length}: {row}")
        rows.append(kept + [length - sum(kept)] if sum(kept) < length else kept)
    return pad_sequence([torch.tensor(r, dtype=torch.int32) for r in rows], batch_first=True)


def _check_tokens(name: str, t: Tensor) -> None:
    """[B, L] integer ids with at least one row."""
    _check_tensor(name, t, ndim=2)
    if t.shape[0] == 0:
        raise LongctxError(f"{name} has shape {tuple(t.shape)}: no rows (B = 0); expected B >= 1")


def _check_tensor(name: str, t: Tensor, ndim: int) -> None:
    if not isinstance(t, Tensor):
        raise LongctxError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise LongctxError(f"{name} has shape {tuple(t.shape)}, expected {ndim} dimensions")
    if t.dtype not in INT_DTYPES:
        raise LongctxError(f"{name} has dtype {t.dtype}, expected an integer dtype")


def _check_seq_lens(seq_lens: Tensor, length: int) -> None:
    """Every row non-negative, summing to L, zero padding trailing; diagnosed only when not."""
    lens = seq_lens.numpy()  # numpy: a handful of torch ops per batch cost more than the packing
    sums = lens.sum(1, dtype=np.int64)
    gaps = (lens[:, 1:] > 0) & (lens[:, :-1] == 0)
    if (lens >= 0).all() and (sums == length).all() and not gaps.any():
        return
    for i, row in enumerate(lens.tolist()):
        if min(row) < 0:
            raise LongctxError(f"seq_lens row {i} has negative lengths: {row}")
        if sums[i] != length:
            raise LongctxError(
                f"seq_lens row {i} sums to {int(sums[i])}, expected L={length}: {row}"
            )
        if gaps[i].any():
            raise LongctxError(
                f"seq_lens row {i} has a zero length before a positive one: {row}; "
                "zero padding must trail"
            )
