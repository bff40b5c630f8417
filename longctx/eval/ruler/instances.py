"""One evaluation instance: input tokens, the answer span at the end, and what it was made of.

An instance of context length ``n`` is ``n + 1`` tokens: the context (a haystack with the task's
needles inserted at their depths), the question, and the answer, whose last token is only a
target. The answer is teacher-forced (scored on the model's argmax of every answer token given
everything before it), so no generation loop is needed and any causal LM can be scored.
An instance is a pure function of (task, length, depth, seed, sample, tokenizer, haystack): its
random choices come from ``random.Random`` seeded with a string, which gives the same stream on
every machine and Python version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.batch import IGNORE_INDEX

# a fixed vocabulary for the noise haystack: sentences that carry no digits and no task markers
_SUBJECTS = ("The river", "A lamp", "The old road", "Every garden", "The wind", "A small boat")
_VERBS = ("runs past", "shines over", "waits beside", "turns toward", "rests under", "follows")
_OBJECTS = ("the hills", "a quiet town", "the grey stones", "the long field", "an open door")
_TAILS = ("in the morning", "at night", "without a sound", "as it always has", "once again")


class RulerInputError(ValueError):
    """Bad input to the suite (a task, length, depth or haystack): the message names the value."""


@dataclasses.dataclass(frozen=True)
class Instance:
    """``tokens`` [length + 1]: inputs are tokens[:-1]; the answer is the last ``answer_len``.

    ``answer``: the answer as text (without its leading separator). ``reference``: the
    (start, stop) token span of the first occurrence of what the answer repeats (copy-at-distance
    scores the repeat against it), and ``distance`` the tokens between the two starts. The
    question is the ``question_len`` tokens before the answer; the context is all before it.
    """

    task: str
    length: int
    depth: float
    sample: int
    seed: int
    tokens: np.ndarray
    answer: str
    answer_len: int
    reference: tuple[int, int] | None = None
    distance: int | None = None
    question_len: int = 0

    def labels(self) -> np.ndarray:
        """int64 [length]: the answer (and reference) tokens at the positions that predict them."""
        labels = np.full(self.length, IGNORE_INDEX, dtype=np.int64)
        labels[-self.answer_len :] = self.tokens[-self.answer_len :]
        if self.reference is not None:
            start, stop = self.reference
            labels[start - 1 : stop - 1] = self.tokens[start:stop]
        return labels

    @property
    def reference_len(self) -> int:
        return 0 if self.reference is None else self.reference[1] - self.reference[0]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a task generator returns: pieces inserted into the haystack, then question + answer.

    ``inserts``: (depth, tokens) pieces, placed at round(depth x haystack tokens), in order for
    equal depths. ``reference``: (insert index, start, stop) of the span the answer repeats.
    """

    inserts: list[tuple[float, np.ndarray]]
    question: np.ndarray
    answer: np.ndarray
    answer_text: str
    reference: tuple[int, int, int] | None = None

    @property
    def fixed_tokens(self) -> int:
        return sum(len(t) for _, t in self.inserts) + len(self.question) + len(self.answer)


def assemble(layout: Layout, haystack: np.ndarray) -> tuple[np.ndarray, tuple[int, int] | None]:
    """The instance's tokens, and the reference span's position in them."""
    n = len(haystack)
    order = sorted(range(len(layout.inserts)), key=lambda i: layout.inserts[i][0])
    parts, cursor, offset, starts = [], 0, 0, {}
    for i in order:
        depth, piece = layout.inserts[i]
        cut = round(depth * n)
        parts.append(haystack[cursor:cut])
        offset += cut - cursor
        starts[i] = offset
        parts.append(piece)
        offset += len(piece)
        cursor = cut
    parts += [haystack[cursor:], layout.question, layout.answer]
    tokens = np.concatenate(parts).astype(np.int64)
    reference = None
    if layout.reference is not None:
        index, start, stop = layout.reference
        reference = (starts[index] + start, starts[index] + stop)
    return tokens, reference


# --------------------------------------------------------------------------- haystacks
def filler_text(rng: random.Random, min_chars: int) -> str:
    """Deterministic sentences from a fixed vocabulary, at least min_chars characters."""
    parts, size = [], 0
    while size < min_chars:
        words = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS))
        sentence = " ".join(words) + " " + rng.choice(_TAILS) + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)


def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


class NoiseHaystack:
    """Sentences from a fixed vocabulary (RULER's "noise" haystack), drawn from the instance's rng."""

    name = "noise"

    def tokens(self, tokenizer, rng: random.Random, count: int) -> np.ndarray:
        chars = max(64, count)
        while True:
            ids = encode(tokenizer, filler_text(rng, chars))
            if len(ids) >= count:
                return ids[:count]
            chars *= 2


class CorpusHaystack:
    """A window of ``count`` consecutive tokens of a prepared folder's documents (one split),
    at an offset drawn from the instance's rng. The documents are joined by a blank line and
    re-encoded with the scoring tokenizer unless it is the folder's own."""

    def __init__(self, folder: str | Path, split: str = "train", name: str | None = None) -> None:
        self.folder, self.split = Path(folder), split
        self.name = name or str(folder)
        if not self.folder.is_dir():
            raise RulerInputError(
                f"haystack folder does not exist ({self.folder}); expected a prepared folder "
                "(python -m longctx.data.prepare), 'books' or 'noise'"
            )
        self._cache: dict[str, np.ndarray] = {}

    def stream(self, tokenizer) -> np.ndarray:
        key = json.dumps(tokenizer.spec, sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self._encode(tokenizer)
        return self._cache[key]

    def _encode(self, tokenizer) -> np.ndarray:
        from longctx.data.shards import ShardSet
        from longctx.data.tokenizer import load_tokenizer

        docs = ShardSet(self.folder, self.split)
        own = load_tokenizer(docs.manifest.tokenizer)
        bodies = [docs.document(i)[:-1] for i in range(docs.num_documents)]  # without EOS
        if tokenizer.spec == docs.manifest.tokenizer:
            sep = encode(own, "\n\n")
            pieces = [p for body in bodies for p in (body, sep)]
            return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        return encode(tokenizer, "\n\n".join(own.decode(body) for body in bodies))

    def tokens(self, tokenizer, rng: random.Random, count: int) -> np.ndarray:
        stream = self.stream(tokenizer)
        if count > len(stream):
            raise RulerInputError(
                f"haystack {self.name} is too small ({len(stream)} tokens in its {self.split} "
                f"split, {count} needed for this length); use a larger corpus or a shorter length"
            )
        start = rng.randrange(len(stream) - count + 1)
        return np.asarray(stream[start : start + count], dtype=np.int64)


def resolve_haystack(spec, cache_dir: str | None = None):
    """'books' (the embedded held-out books: no training row holds them), 'embedded' (the
    embedded corpus's training chapters: for training documents), 'noise', a prepared folder,
    or a haystack object (returned as is)."""
    if not isinstance(spec, str | Path):
        return spec
    from longctx.data.corpus import default_corpus_dir, long_documents_dir

    if str(spec) == "noise":
        return NoiseHaystack()
    if str(spec) == "books":
        return CorpusHaystack(long_documents_dir(cache_dir), "train", name="books")
    if str(spec) == "embedded":
        return CorpusHaystack(default_corpus_dir(cache_dir), "train", name="embedded")
    return CorpusHaystack(Path(spec), "train")


# --------------------------------------------------------------------------- inspection
def instance_record(instance: Instance, tokenizer) -> dict:
    """One JSONL row: what the model reads, the answer, and a digest of the token ids."""
    answer = instance.tokens[-instance.answer_len :]
    question_start = len(instance.tokens) - instance.answer_len - instance.question_len
    return {
        "task": instance.task,
        "length": instance.length,
        "depth": instance.depth,
        "sample": instance.sample,
        "seed": instance.seed,
        "answer": instance.answer,
        "answer_text": tokenizer.decode(answer),
        "answer_tokens": [int(t) for t in answer],
        "context": tokenizer.decode(instance.tokens[:question_start]),
        "question": tokenizer.decode(instance.tokens[question_start : -instance.answer_len]),
        "distance": instance.distance,
        "tokens_sha256": tokens_digest([instance]),
    }


def write_instances(instances: Sequence[Instance], tokenizer, path: str | Path) -> Path:
    """Every instance as one JSON line (its text, answer and token digest)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for instance in instances:
            f.write(json.dumps(instance_record(instance, tokenizer), ensure_ascii=False) + "\n")
    return path


def tokens_digest(instances: Sequence[Instance]) -> str:
    """sha256 of the instances' token ids (int64 little endian): equal on every machine."""
    digest = hashlib.sha256()
    for instance in instances:
        digest.update(np.asarray(instance.tokens, dtype="<i8").tobytes())
    return digest.hexdigest()
