"""Packers: turn a stream of documents into rows of exactly L tokens.

Two strategies, one interface (``pack``, ``stats``):

- ``concat_chunk`` (Megatron / torchtitan): concatenate the documents and cut every L tokens.
  Documents are split across rows; only the very last row of a finite stream is padded.
- ``best_fit``: best-fit-decreasing within a buffer of documents ("Fewer Truncations Improve
  Language Modeling", Ding et al. 2024). A document is split only when it is longer than L;
  leftover space in a row is a pad segment.

Each packer is two stages. A *planner* sees only document lengths and decides which piece
``(doc, start, length)`` of which document goes into which row; the *assembler* copies those
pieces into token and label arrays (a few numpy slice copies per row). The planner can be
benchmarked on lengths alone. A packer is a pure function of its documents and settings: a
resumed run replays it (longctx.data.streams), it keeps no checkpointable state.

Document boundaries come from the documents themselves: each one ends with the tokenizer's EOS
(prepare appends it), so the rows' segments are exactly what EOS-derived boundaries give
(Megatron's reset-at-EOD, ``PackedBatch.from_eos``). With ``bos_id`` a packer puts BOS in front
of every document it is given, so BOS is the first token of each segment that starts a document
(Llama 3's ``<|begin_of_text|> text <|end_of_text|>``; the prepared tokens stay the text's own).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from longctx.batch import IGNORE_INDEX, PackedBatch, position_ids_for
from longctx.errors import LongctxError

PAD_DOC = -1  # the document index of a pad piece
# A piece of a row: (document index, start offset in the document, length).
Piece = tuple[int, int, int]
_ROW_BITS = 32  # best-fit keys: capacity << 32 | row
_ROW_MASK = (1 << _ROW_BITS) - 1
# best_fit keeps a row padded by more than this fraction of L open for one more buffer.
CARRY_PAD_FRACTION = 0.005


@dataclasses.dataclass
class PackedRow:
    """One packed row of L tokens.

    tokens      int64 [L]  input ids
    labels      int64 [L]  shifted targets; -100 at every document's last token and on pad
    seq_lens    int32 [S]  the row's segments in order (documents, fragments, a pad tail); sums to L
    pad_tokens  int        the pad tail's length (0: no pad segment). Said by the packer, as
                           neither tokens (pad may be EOS) nor labels (a 1-token document has
                           no target either) tell pad apart.
    """

    tokens: np.ndarray
    labels: np.ndarray
    seq_lens: np.ndarray
    pad_tokens: int = 0

    @property
    def documents(self) -> int:
        """Document segments (whole documents or fragments): every segment but the pad tail."""
        return len(self.seq_lens) - (self.pad_tokens > 0)


@dataclasses.dataclass
class PackingStats:
    """Running statistics over the rows a packer has yielded."""

    rows: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    segments: int = 0  # non-pad segments: whole documents and document fragments
    splits: int = 0  # cuts inside a document (a document in k pieces counts k - 1)

    @property
    def efficiency(self) -> float:
        """Fraction of row tokens that are document tokens (not pad)."""
        return 1.0 - self.pad_tokens / self.tokens if self.tokens else 0.0

    @property
    def docs_per_row(self) -> float:
        """Mean number of document segments (whole documents or fragments) per row."""
        return self.segments / self.rows if self.rows else 0.0

    def record(self, pieces: Sequence[Piece], length_of: Callable[[int], int]) -> None:
        """Count one row; ``length_of(doc)`` is a document's full length."""
        for doc, start, length in pieces:
            self.tokens += length
            if doc == PAD_DOC:
                self.pad_tokens += length
            else:
                self.segments += 1
                self.splits += start + length < length_of(doc)
        self.rows += 1


class _ConcatChunkPlanner:
    """Lengths only: concatenate documents and cut a row every ``seq_len`` tokens."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.ready: deque[tuple[Piece, ...]] = deque()
        self.pieces_left: dict[int, int] = {}  # planned, not yet assembled pieces per document
        self.open_row: list[Piece] = []
        self.open_fill = 0

    def add(self, doc: int, length: int) -> None:
        start = 0
        # starting at fill f of the open row, the document spans ceil((f + length) / L) rows
        self.pieces_left[doc] = -(-(length + self.open_fill) // self.seq_len)
        while start < length:
            take = min(self.seq_len - self.open_fill, length - start)
            self.open_row.append((doc, start, take))
            self.open_fill += take
            start += take
            if self.open_fill == self.seq_len:
                self.ready.append(tuple(self.open_row))
                self.open_row, self.open_fill = [], 0

    def flush(self) -> None:
        """End of stream: the partial last row gets a pad tail (the only padding here)."""
        if self.open_row:
            self.open_row.append((PAD_DOC, 0, self.seq_len - self.open_fill))
            self.ready.append(tuple(self.open_row))
            self.open_row, self.open_fill = [], 0


class _BestFitPlanner:
    """Lengths only: best-fit-decreasing over a buffer of ``buffer_size`` documents.

    A document longer than L contributes full L-token rows of its own and one remainder piece
    that is packed like any document. Pieces go in decreasing length into the open row with the
    least remaining capacity that still fits (bisect over sorted capacities, O(log n) search).

    A small buffer leaves its last row half empty (at L = 128k a buffer of 1000 documents fills
    only ~9 rows). So, except at the end of the stream, a row padded by more than
    ``CARRY_PAD_FRACTION`` of L stays open into the next buffer, once: the next documents fill
    it. Carrying a row only once bounds the delay and the memory (at most two buffers).
    Emitted rows are shuffled by (seed, buffer index), so row order does not follow length.
    """

    def __init__(self, seq_len: int, buffer_size: int, seed: int) -> None:
        self.seq_len = seq_len
        self.buffer_size = buffer_size
        self.seed = seed
        self.ready: deque[tuple[Piece, ...]] = deque()
        self.pieces_left: dict[int, int] = {}  # planned, not yet assembled pieces per document
        self.buffer: list[Piece] = []  # whole documents: (doc, 0, length)
        self.carried: list[list[Piece]] = []  # open rows kept from the last buffer
        self.buffers_planned = 0

    def add(self, doc: int, length: int) -> None:
        self.pieces_left[doc] = -(-length // self.seq_len)  # full L pieces + a remainder
        self.buffer.append((doc, 0, length))
        if len(self.buffer) >= self.buffer_size:
            self._plan(final=False)

    def flush(self) -> None:
        if self.buffer or self.carried:
            self._plan(final=True)

    def _plan(self, final: bool) -> None:
        rows, free = best_fit_rows(self.buffer, self.seq_len, open_rows=self.carried)
        limit = 0 if final else CARRY_PAD_FRACTION * self.seq_len
        first_new = len(self.carried)  # rows carried once are emitted however full they are
        carried, emitted = [], []
        for r, (row, row_free) in enumerate(zip(rows, free, strict=True)):
            if r >= first_new and row_free > limit and not final:
                carried.append(row)
            else:
                emitted.append((*row, (PAD_DOC, 0, row_free)) if row_free else tuple(row))
        self.carried, self.buffer = carried, []
        rng = np.random.default_rng((self.seed, self.buffers_planned))
        self.ready.extend(emitted[i] for i in rng.permutation(len(emitted)))
        self.buffers_planned += 1


def _free_of(row: Sequence[Piece], seq_len: int) -> int:
    return seq_len - sum(length for _, _, length in row)


def best_fit_rows(
    pieces: Sequence[Piece], seq_len: int, open_rows: Sequence[list[Piece]] = ()
) -> tuple[list[list[Piece]], list[int]]:
    """Best-fit-decreasing plan of one buffer: rows (lists of pieces, no pad) in creation order,
    and each row's free capacity.

    ``open_rows`` are partially filled rows to fill first; they come back first, extended.
    """
    rows = [list(row) for row in open_rows]
    free = [_free_of(row, seq_len) for row in rows]
    remainders: list[Piece] = []  # what is left to fit: pieces shorter than L
    for piece in pieces:
        doc, start, length = piece
        if length < seq_len:
            remainders.append(piece)
            continue
        full, rest = divmod(length, seq_len)
        for j in range(full):
            rows.append([(doc, start + j * seq_len, seq_len)])
            free.append(0)
        if rest:
            remainders.append((doc, start + full * seq_len, rest))
    remainders.sort(key=itemgetter(2), reverse=True)  # stable: ties keep stream order
    _fit_decreasing(remainders, rows, free, seq_len)
    return rows, free


def _fit_decreasing(
    remainders: list[Piece], rows: list[list[Piece]], free: list[int], seq_len: int
) -> None:
    """Put each piece into the open row with the least free capacity that still fits.

    Keys pack (capacity, row) into one int, so one bisect over the sorted keys finds the
    tightest fitting row (O(log n) search; list insert/pop are memmoves of a few hundred keys).
    The hot loop of best_fit planning, so its lookups are local names.
    """
    open_keys = sorted(f << _ROW_BITS | r for r, f in enumerate(free) if f)
    search, insert, take = bisect_left, insort, open_keys.pop
    for piece in remainders:
        length = piece[2]
        i = search(open_keys, length << _ROW_BITS)
        if i < len(open_keys):
            key = take(i)
            row, left = key & _ROW_MASK, (key >> _ROW_BITS) - length
            rows[row].append(piece)
        else:  # nothing fits: open a new row
            row, left = len(rows), seq_len - length
            rows.append([piece])
            free.append(0)
        free[row] = left
        if left:
            insert(open_keys, left << _ROW_BITS | row)


def assemble_row(
    pieces: Sequence[Piece], documents: dict[int, np.ndarray], seq_len: int, pad_id: int
) -> PackedRow:
    """Copy the planned pieces into one row; labels never cross a document end.

    One slice copy per piece; the labels are the row shifted by one, then fixed at each
    piece's last position: -100 where the piece ends its document, else (a fragment) the
    document's next token, which lives in another row.
    """
    tokens = np.empty(seq_len, dtype=np.int64)
    labels = np.empty(seq_len, dtype=np.int64)
    seq_lens = np.array([length for _, _, length in pieces], dtype=np.int32)
    continuations: list[tuple[int, int]] = []  # (row position, next token) of fragments
    pads: list[tuple[int, int]] = []
    pos = 0
    for doc, start, length in pieces:
        end = pos + length
        if doc == PAD_DOC:
            tokens[pos:end] = pad_id
            pads.append((pos, end))
        else:
            source = documents[doc]
            stop = start + length
            tokens[pos:end] = source[start:stop]
            if stop < len(source):
                continuations.append((end - 1, source[stop]))
        pos = end
    labels[:-1] = tokens[1:]
    labels[np.cumsum(seq_lens) - 1] = IGNORE_INDEX
    for position, token in continuations:
        labels[position] = token
    for pad_start, pad_end in pads:
        labels[pad_start:pad_end] = IGNORE_INDEX
    pad_tokens = sum(end - start for start, end in pads)
    return PackedRow(tokens=tokens, labels=labels, seq_lens=seq_lens, pad_tokens=pad_tokens)


class Packer(Protocol):
    seq_len: int

    def pack(self, documents: Iterable[np.ndarray]) -> Iterator[PackedRow]: ...

    @property
    def stats(self) -> PackingStats: ...


class _PlannedPacker:
    """Shared driver: pull documents, let the planner plan rows, assemble and yield them."""

    def __init__(self, seq_len: int, planner, pad_id: int, bos_id: int | None) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.bos_id = bos_id
        self._planner = planner
        self._documents: dict[int, np.ndarray] = {}  # pulled documents still needed
        self._documents_consumed = 0
        self._stats = PackingStats()

    @property
    def stats(self) -> PackingStats:
        return self._stats

    def pack(self, documents: Iterable[np.ndarray]) -> Iterator[PackedRow]:
        stream = iter(documents)
        while True:
            if not self._planner.ready and not self._plan_more(stream):
                return
            yield self._emit(self._planner.ready.popleft())

    def _plan_more(self, stream: Iterator[np.ndarray]) -> bool:
        """Pull documents until the planner has a row ready; False once nothing is left."""
        ready = self._planner.ready
        while not ready:
            document = next(stream, None)
            if document is None:
                self._planner.flush()
                return bool(ready)
            index = self._documents_consumed
            self._documents[index] = _with_bos(_checked_document(document, index), self.bos_id)
            self._documents_consumed += 1
            self._planner.add(index, len(self._documents[index]))
        return True

    def _emit(self, pieces: tuple[Piece, ...]) -> PackedRow:
        documents = self._documents
        row = assemble_row(pieces, documents, self.seq_len, self.pad_id)
        self._stats.record(pieces, lambda doc: len(documents[doc]))
        self._release(pieces)
        return row

    def _release(self, pieces: tuple[Piece, ...]) -> None:
        """Drop each document whose last planned piece has now been assembled."""
        pieces_left, documents = self._planner.pieces_left, self._documents
        for doc, _, _ in pieces:
            if doc == PAD_DOC:
                continue
            left = pieces_left[doc] - 1
            if left:
                pieces_left[doc] = left
            else:
                del pieces_left[doc], documents[doc]


class ConcatChunkPacker(_PlannedPacker):
    """Concatenate documents and cut every ``seq_len`` tokens (no padding but the last row)."""

    def __init__(self, seq_len: int, *, pad_id: int = 0, bos_id: int | None = None) -> None:
        _check_positive("seq_len", seq_len)
        super().__init__(seq_len, _ConcatChunkPlanner(seq_len), pad_id, bos_id)


class BestFitPacker(_PlannedPacker):
    """Best-fit-decreasing within a buffer of ``buffer_size`` documents; pad the rest."""

    def __init__(
        self,
        seq_len: int,
        *,
        pad_id: int = 0,
        buffer_size: int = 1000,
        seed: int = 0,
        bos_id: int | None = None,
    ):
        _check_positive("seq_len", seq_len)
        _check_positive("buffer_size", buffer_size)
        planner = _BestFitPlanner(seq_len, buffer_size, seed)
        super().__init__(seq_len, planner, pad_id, bos_id)
        self.buffer_size = buffer_size
        self.seed = seed


def make_packer(
    name: str,
    seq_len: int,
    *,
    pad_id: int = 0,
    buffer_size: int = 1000,
    seed: int = 0,
    bos_id: int | None = None,
    answer_keys: tuple[int, int] | None = None,
) -> Packer:
    """A packer by name: "concat_chunk" or "best_fit"; ``bos_id``: BOS before every document;
    ``answer_keys``: keep only answer labels (:func:`answers_only`)."""
    if name == "concat_chunk":
        packer = ConcatChunkPacker(seq_len, pad_id=pad_id, bos_id=bos_id)
    elif name == "best_fit":
        packer = BestFitPacker(
            seq_len, pad_id=pad_id, buffer_size=buffer_size, seed=seed, bos_id=bos_id
        )
    else:
        raise LongctxError(f"unknown packer {name!r}; expected one of 'concat_chunk', 'best_fit'")
    return packer if answer_keys is None else AnswersOnly(packer, answer_keys)


class AnswersOnly:
    """A packer whose rows keep only their answer labels (``data.loss_tokens=answers``)."""

    def __init__(self, packer: Packer, answer_keys: tuple[int, int]) -> None:
        self.packer, self.answer_keys = packer, answer_keys
        self.seq_len = packer.seq_len

    @property
    def stats(self) -> PackingStats:
        return self.packer.stats

    def pack(self, documents: Iterable[np.ndarray]) -> Iterator[PackedRow]:
        for row in self.packer.pack(documents):
            yield answers_only(row, self.answer_keys)


def answers_only(row: PackedRow, answer_keys: tuple[int, int]) -> PackedRow:
    """``row`` with a label only where a query asks for it: at a key (an id in ``answer_keys``'
    [low, high)) that already occurred earlier in the same segment, whose label is the token
    that answers it (MQAR's value after a queried key). Every other label becomes -100."""
    low, high = answer_keys
    tokens = row.tokens
    segment = np.repeat(np.arange(len(row.seq_lens)), row.seq_lens)
    _, first, inverse = np.unique(
        segment.astype(np.int64) * (int(tokens.max()) + 1) + tokens,
        return_index=True,
        return_inverse=True,
    )
    repeated = first[inverse] != np.arange(len(tokens))
    query = repeated & (tokens >= low) & (tokens < high)
    labels = np.where(query, row.labels, IGNORE_INDEX)
    return dataclasses.replace(row, labels=labels)


def collate_rows(
    rows: Sequence[PackedRow], *, reset_position_ids: bool, document_mask: bool
) -> PackedBatch:
    """Stack rows into a PackedBatch.

    Position ids always follow the rows' document segments (reset or continuous). With
    ``document_mask=False`` each row becomes one segment of L for attention (the no-masking
    ablation) while tokens, labels and position ids stay exactly those of the masked arm.
    """
    if not rows:
        raise ValueError("collate_rows got no rows; expected at least one PackedRow")
    length = len(rows[0].tokens)
    for i, row in enumerate(rows):
        _check_row_arrays(row, i, length)
    doc_lens = pad_sequence(
        [torch.as_tensor(r.seq_lens, dtype=torch.int32) for r in rows], batch_first=True
    )
    _check_row_lengths(doc_lens.numpy(), rows, length)
    tokens = torch.from_numpy(np.stack([r.tokens for r in rows]))
    labels = torch.from_numpy(np.stack([r.labels for r in rows]))
    positions = position_ids_for(doc_lens, length, reset_position_ids)
    seq_lens = doc_lens if document_mask else torch.full((len(rows), 1), length, dtype=torch.int32)
    return PackedBatch(tokens, labels, positions, seq_lens)


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise LongctxError(f"{name}={value!r}; expected an integer >= 1")


def _checked_document(document, index: int) -> np.ndarray:
    document = np.asarray(document)
    if document.ndim != 1:
        raise LongctxError(
            f"document {index} has shape {document.shape}; expected a 1-D token array"
        )
    if document.dtype.kind not in "iu":
        raise LongctxError(
            f"document {index} has dtype {document.dtype}; expected an integer token dtype"
        )
    if len(document) == 0:
        raise LongctxError(f"document {index} is empty; expected at least one token (its EOS)")
    return document


def _with_bos(document: np.ndarray, bos_id: int | None) -> np.ndarray:
    """``document`` with ``bos_id`` in front (one copy), or as it is without one."""
    if bos_id is None:
        return document
    return np.concatenate((np.asarray([bos_id], dtype=document.dtype), document))


def _check_row_arrays(row: PackedRow, index: int, length: int) -> None:
    for name in ("tokens", "labels"):
        array = getattr(row, name)
        if array.shape != (length,) or array.dtype.kind not in "iu":
            raise ValueError(
                f"row {index} {name} has shape {array.shape} dtype {array.dtype}; "
                f"expected an integer array of shape ({length},)"
            )


def _check_row_lengths(doc_lens: np.ndarray, rows: Sequence[PackedRow], length: int) -> None:
    """Every row's seq_lens must be positive and sum to L (checked for all rows at once)."""
    bad = (doc_lens.sum(1, dtype=np.int64) != length) | (
        (doc_lens > 0).sum(1) != [len(r.seq_lens) for r in rows]
    )
    for i in np.flatnonzero(bad)[:1]:
        raise ValueError(
            f"row {i} seq_lens {rows[i].seq_lens.tolist()} must be positive and sum to L={length}"
        )
