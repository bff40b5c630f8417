"""Associative recall read off a trained model: held-out MQAR instances under four conditions,
scored teacher-forced (argmax at the query key) and, where asked, through greedy generation.

Conditions (``docs/recall.md``):
- ``in_distribution``: rows of L packed with documents of the training distribution.
- ``interference``: such rows whose last document is scored, every one of its keys bound to
  another value by an earlier document of the row (a leak across documents answers wrongly).
- ``length``: single documents whose queries sit ``distance`` tokens past their keys, in
  buckets past the longest training document, up to 2L.
Each arm reads the rows as it was trained: its own ``document_mask`` and ``reset_position_ids``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data.packing import PackedRow, collate_rows
from longctx.model.generate import generate_from_batch
from longctx.synthetic.mqar import FILLER, MqarDocument, MqarSpec

CONDITIONS = ("in_distribution", "interference", "length")


@dataclasses.dataclass(frozen=True)
class RecallRow:
    """One row to score: its documents in order, the indices of those whose queries count, and
    its length (a filler tail pads it)."""

    condition: str
    docs: tuple[MqarDocument, ...]
    scored: tuple[int, ...]
    length: int
    target_distance: int | None = None  # the length condition's: its first query's, nominally

    def packed(self) -> PackedRow:
        tokens = np.concatenate([d.tokens for d in self.docs])
        pad = self.length - len(tokens)
        if pad < 0:
            raise ValueError(
                f"{len(tokens)} tokens of documents exceed the row length {self.length}"
            )
        seq_lens = [len(d.tokens) for d in self.docs] + ([pad] if pad else [])
        tokens = np.concatenate([tokens, np.full(pad, FILLER, np.int64)])
        labels = np.full(self.length, IGNORE_INDEX, np.int64)
        for q, answer in zip(self.query_positions(), self.answers(), strict=True):
            labels[q] = answer
        return PackedRow(tokens, labels, np.asarray(seq_lens, np.int32), pad)

    def starts(self) -> np.ndarray:
        return np.cumsum([0] + [len(d.tokens) for d in self.docs])[:-1]

    def query_positions(self) -> np.ndarray:
        starts = self.starts()
        return np.concatenate([starts[i] + self.docs[i].query_positions for i in self.scored])

    def answers(self) -> np.ndarray:
        return np.concatenate([self.docs[i].answers for i in self.scored])

    def distances(self) -> np.ndarray:
        return np.concatenate([self.docs[i].distances for i in self.scored])


def pack_documents(rng: np.random.Generator, spec: MqarSpec, length: int) -> list[MqarDocument]:
    """Documents of ``spec`` in order until the next would not fit ``length``."""
    docs, used = [], 0
    while True:
        doc = spec.document(rng)
        if used + len(doc.tokens) > length:
            return docs
        docs.append(doc)
        used += len(doc.tokens)


def in_distribution_row(rng: np.random.Generator, spec: MqarSpec, length: int) -> RecallRow:
    docs = pack_documents(rng, spec, length)
    return RecallRow("in_distribution", tuple(docs), tuple(range(len(docs))), length)


def interference_row(rng: np.random.Generator, spec: MqarSpec, length: int) -> RecallRow:
    """A packed row whose last document's keys are each rebound, to another value, in a
    random earlier document (its pair and its query both)."""
    docs = pack_documents(rng, spec, length)
    while len(docs) < 2:
        docs = pack_documents(rng, spec, length)
    target = docs[-1]
    earlier = [_copy(d) for d in docs[:-1]]
    keys, values = target.tokens[target.key_positions], target.answers
    for key, value in zip(keys, values, strict=True):
        doc = earlier[rng.integers(len(earlier))]
        _rebind(rng, doc, key, value)
    return RecallRow("interference", (*earlier, target), (len(docs) - 1,), length)


def length_document(
    rng: np.random.Generator, spec: MqarSpec, num_pairs: int, distance: int
) -> RecallRow:
    """One document of ``num_pairs`` pairs whose queries follow filler that puts the first
    query about ``distance`` tokens past its key."""
    from longctx.synthetic.mqar import mqar_document

    lead = max(0, distance - 2 * num_pairs)
    doc = mqar_document(rng, spec.vocab, num_pairs, spec.slots(num_pairs), spec.power_a, lead)
    return RecallRow("length", (doc,), (0,), len(doc.tokens), distance)


def _copy(doc: MqarDocument) -> MqarDocument:
    return MqarDocument(doc.tokens.copy(), doc.query_positions, doc.key_positions)


def _rebind(rng: np.random.Generator, doc: MqarDocument, key: int, value: int) -> None:
    """Make ``doc`` bind ``key`` to a value other than ``value`` (in place): a pair of it whose
    key is not ``key`` already takes ``key``, in its pair and its query."""
    tokens = doc.tokens
    if key in tokens[doc.key_positions]:
        i = int(np.flatnonzero(tokens[doc.key_positions] == key)[0])
    else:
        i = int(rng.integers(len(doc.key_positions)))
        tokens[doc.key_positions[i]] = tokens[doc.query_positions[i]] = key
    if tokens[doc.key_positions[i] + 1] == value:  # same value by chance: take another's
        j = (i + 1) % len(doc.key_positions)
        a, b = doc.key_positions[i] + 1, doc.key_positions[j] + 1
        if len(doc.key_positions) == 1:
            return
        tokens[a], tokens[b] = tokens[b], tokens[a]
        qa, qb = doc.query_positions[i] + 1, doc.query_positions[j] + 1
        tokens[qa], tokens[qb] = tokens[qb], tokens[qa]


# --------------------------------------------------------------------------- scoring
@dataclasses.dataclass(frozen=True)
class Arm:
    document_mask: bool
    reset_position_ids: bool


def batch_of(rows: Sequence[RecallRow], arm: Arm) -> PackedBatch:
    return collate_rows(
        [r.packed() for r in rows],
        reset_position_ids=arm.reset_position_ids,
        document_mask=arm.document_mask,
    )


@torch.no_grad()
def teacher_forced(model, rows: Sequence[RecallRow], arm: Arm) -> np.ndarray:
    """The argmax at every scored query, row-major (rows of one length)."""
    batch = batch_of(rows, arm).to(model.output_weight.device)
    return model.labelled_logits(batch).argmax(-1).cpu().numpy()


@torch.no_grad()
def generated(model, row: RecallRow, arm: Arm) -> np.ndarray:
    """One greedy token after every scored query key, each from its own prompt (the row up to
    and including the key) through prefill: the suite's generation path."""
    full = batch_of([row], arm)
    out = []
    for q in row.query_positions():
        out.append(generate_from_batch(model, _prefix(full, int(q) + 1), max_new_tokens=1)[0][0])
    return np.asarray(out)


def _prefix(batch: PackedBatch, n: int) -> PackedBatch:
    """The first ``n`` tokens of a one-row batch, its segments cut there."""
    ends = torch.cumsum(batch.seq_lens[0].long(), 0)
    lens = batch.seq_lens[0][ends - batch.seq_lens[0] < n].clone()
    lens[-1] -= int(ends[len(lens) - 1]) - n
    return PackedBatch(
        batch.tokens[:, :n], batch.labels[:, :n], batch.position_ids[:, :n], lens[None]
    )


def records(rows: Sequence[RecallRow], predictions: np.ndarray) -> Iterator[dict]:
    """One record per scored query: condition, row, query (its index in the row), target
    distance (length documents), distance, answer, prediction, correct."""
    i = 0
    for r, row in enumerate(rows):
        for q, (distance, answer) in enumerate(zip(row.distances(), row.answers(), strict=True)):
            pred = int(predictions[i])
            i += 1
            yield dict(
                condition=row.condition,
                row=r,
                query=q,
                target_distance=row.target_distance or "",
                distance=int(distance),
                answer=int(answer),
                prediction=pred,
                correct=int(pred == answer),
            )
