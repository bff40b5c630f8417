"""Associative recall read off a trained model: held-out MQAR instances under four conditions,
scored teacher-forced (argmax at the query key) and, where asked, through greedy generation.

Conditions (``docs/recall.md``):
- ``in_distribution``: rows of L packed with documents of the training distribution.
- ``interference``: such rows whose last document is scored, every one of its keys bound to
  another value by an earlier document of the row (a leak across documents answers wrongly).
- ``length``: single documents whose queries sit ``distance`` tokens past their keys, in
  buckets past the longest training document, up to 2L.
- ``anchor``: Zoology's Figure 2 point (sequence 256, 16 pairs, queries at power-law gaps over
  the 112 slots after the pairs), single documents: the published grid's anchor.
Each arm reads the rows as it was trained: its own ``document_mask`` and ``reset_position_ids``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data.packing import PackedRow, collate_rows
from longctx.errors import LongctxError
from longctx.model.generate import generate_from_batch
from longctx.synthetic.mqar import FILLER, MqarDocument, MqarSpec, mqar_document

CONDITIONS = ("in_distribution", "interference", "length", "anchor")
ANCHOR_LENGTH, ANCHOR_PAIRS = 256, 16  # Zoology's Figure 2: (sequence length, pairs)


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
    if length < spec.max_doc_len:  # else a row may hold no document at all
        raise LongctxError(
            f"rows of {length} tokens are shorter than the longest document "
            f"({spec.max_doc_len}); expected rows at least that long"
        )
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
    """A packed row whose last document's keys are each bound, to another value, by an earlier
    document (its pair and its query both), and by none to the same value."""
    for _ in range(INTERFERENCE_TRIES):
        docs = pack_documents(rng, spec, length)
        earlier = [_copy(d) for d in docs[:-1]]
        if len(docs) >= 2 and _interfere(rng, spec, earlier, docs[-1]):
            return RecallRow("interference", (*earlier, docs[-1]), (len(docs) - 1,), length)
    raise LongctxError(
        f"rows of {length} tokens rarely hold earlier documents with as many pairs as the last "
        f"({INTERFERENCE_TRIES} tries); expected rows several times longer than {spec.max_doc_len}"
    )


INTERFERENCE_TRIES = 1000


def _interfere(
    rng: np.random.Generator, spec: MqarSpec, earlier: list[MqarDocument], target: MqarDocument
) -> bool:
    """Rebind ``target``'s keys in ``earlier`` (in place); False where their pairs run out."""
    keys = target.tokens[target.key_positions]
    for key, value in zip(keys, target.answers, strict=True):
        homes = [d for d in earlier if key in d.tokens[d.key_positions]]
        if not homes:  # take a pair that binds none of the target's keys
            free = [d for d in earlier if not np.isin(d.tokens[d.key_positions], keys).all()]
            if not free:
                return False
            doc = free[rng.integers(len(free))]
            i = rng.choice(np.flatnonzero(~np.isin(doc.tokens[doc.key_positions], keys)))
            doc.tokens[doc.key_positions[i]] = doc.tokens[doc.query_positions[i]] = key
            homes = [doc]
        for doc in homes:  # none binds it to the target's own value
            i = int(np.flatnonzero(doc.tokens[doc.key_positions] == key)[0])
            if doc.tokens[doc.key_positions[i] + 1] == value:
                _other_value(rng, spec, doc, i)
    return True


def length_document(
    rng: np.random.Generator, spec: MqarSpec, num_pairs: int, distance: int
) -> RecallRow:
    """One document of ``num_pairs`` pairs whose queries follow filler that puts every query at
    least ``distance`` tokens past its key (the first one at most ``2 * num_pairs - 2`` more)."""
    # the last pair's key sits 2 tokens before the filler: the nearest any query can be
    lead = max(0, distance - 2)
    doc = mqar_document(rng, spec.vocab, num_pairs, spec.slots(num_pairs), spec.power_a, lead)
    return RecallRow("length", (doc,), (0,), len(doc.tokens), distance)


def anchor_document(rng: np.random.Generator, spec: MqarSpec) -> RecallRow:
    """Zoology's (256, 16) example as one document: 16 pairs, then 16 queries over the
    (256 - 32) / 2 slots of the rest (plus EOS)."""
    slots = (ANCHOR_LENGTH - 2 * ANCHOR_PAIRS) // 2
    doc = mqar_document(rng, spec.vocab, ANCHOR_PAIRS, slots, spec.power_a)
    return RecallRow("anchor", (doc,), (0,), len(doc.tokens))


def _copy(doc: MqarDocument) -> MqarDocument:
    return MqarDocument(doc.tokens.copy(), doc.query_positions, doc.key_positions)


def _other_value(rng: np.random.Generator, spec: MqarSpec, doc: MqarDocument, i: int) -> None:
    """Give pair ``i`` of ``doc`` another value (in place), in its pair and its query: another
    pair's (the two swap), or, in a one-pair document, any other."""
    tokens, pairs = doc.tokens, len(doc.key_positions)
    a = doc.key_positions[i] + 1, doc.query_positions[i] + 1
    if pairs == 1:
        old = tokens[a[0]] - spec.vocab.first_value
        new = (old + 1 + rng.integers(spec.vocab.num_values - 1)) % spec.vocab.num_values
        tokens[list(a)] = spec.vocab.first_value + new
        return
    j = (i + 1 + rng.integers(pairs - 1)) % pairs
    b = doc.key_positions[j] + 1, doc.query_positions[j] + 1
    tokens[list(a + b)] = tokens[list(b + a)]


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
