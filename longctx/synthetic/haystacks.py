"""Haystacks: sources of context units (sentences), each encoded with its leading separator.

A haystack has ``name`` and ``units(enc, rng, sep)``, an endless iterator of token arrays. The
corpora are named by longctx.data.corpus.resolve_haystack; a prepared folder's documents are
decoded with the folder's own tokenizer, and the tasks encode the sentences with the scoring
tokenizer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator

import numpy as np

from longctx.errors import LongctxError
from longctx.synthetic.pieces import Encoder, TaskInputError

# RULER's noise haystack: this sentence, repeated
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# the lc_* tasks' filler ("noise"): sentences from a fixed vocabulary, no digits
_SUBJECTS = ("The river", "A lamp", "The old road", "Every garden", "The wind", "A small boat")
_VERBS = ("runs past", "shines over", "waits beside", "turns toward", "rests under", "follows")
_OBJECTS = ("the hills", "a quiet town", "the grey stones", "the long field", "an open door")
_TAILS = ("in the morning", "at night", "without a sound", "as it always has", "once again")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


class Units:
    """``tokens(tokenizer, rng, count)``: exactly ``count`` tokens of consecutive units (a
    filler for generators that place their own pieces)."""

    def units(self, enc: Encoder, rng: random.Random, sep: str) -> Iterator[np.ndarray]:
        raise NotImplementedError

    def tokens(self, tokenizer, rng: random.Random, count: int) -> np.ndarray:
        enc = tokenizer if isinstance(tokenizer, Encoder) else Encoder(tokenizer)
        pieces, total = [np.zeros(0, np.int64)], 0
        for unit in self.units(enc, rng, " "):
            if total >= count:
                break
            pieces.append(unit[: count - total])
            total += len(pieces[-1])
        return np.concatenate(pieces).astype(np.int64)


class NoiseHaystack(Units):
    """RULER's noise: ``NOISE`` repeated, one unit per repetition (``end`` appended to each)."""

    name = "ruler_noise"

    def __init__(self, end: str = "") -> None:
        self.end = end

    def units(self, enc: Encoder, rng: random.Random, sep: str) -> Iterator[np.ndarray]:
        unit = enc(sep + NOISE + self.end)
        while True:
            yield unit


class FillerHaystack(Units):
    """The lc_* tasks' filler: sentences from a fixed vocabulary, drawn from the instance's rng."""

    name = "noise"

    def units(self, enc: Encoder, rng: random.Random, sep: str) -> Iterator[np.ndarray]:
        while True:
            words = (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS))
            yield enc(f"{sep}{' '.join(words)} {rng.choice(_TAILS)}.")


def split_sentences(text: str) -> list[str]:
    """Whitespace-normalised sentences (RULER normalises its essays' whitespace the same way)."""
    text = re.sub(r"\s+", " ", text).strip()
    return [s for s in _SENTENCE_END.split(text) if s]


class TextHaystack(Units):
    """Consecutive sentences of a text from an offset drawn from the instance's rng, wrapping
    around at its end (RULER repeats its essays when a length needs more)."""

    def __init__(self, text: str, name: str) -> None:
        self.name = name
        self.sentences = split_sentences(text)
        if not self.sentences:
            raise LongctxError(f"haystack {name} holds no text")

    def units(self, enc: Encoder, rng: random.Random, sep: str) -> Iterator[np.ndarray]:
        i = rng.randrange(len(self.sentences))
        while True:
            yield enc(sep + self.sentences[i])
            i = (i + 1) % len(self.sentences)


class CorpusHaystack(Units):
    """The sentences of a corpus (``read()``: its text, read on first use), from an offset
    drawn from the instance's rng. ``where``: which part of the corpus, for the refusal of one
    that holds no text."""

    def __init__(self, name: str, read: Callable[[], str], where: str = "") -> None:
        self.name, self._read, self._where = name, read, where
        self._text: TextHaystack | None = None

    def text(self) -> TextHaystack:
        if self._text is None:
            text = self._read()
            try:
                self._text = TextHaystack(text, self.name)
            except LongctxError:
                raise TaskInputError(
                    f"haystack {self.name} holds no text{self._where}; use another"
                ) from None
        return self._text

    def units(self, enc: Encoder, rng: random.Random, sep: str) -> Iterator[np.ndarray]:
        return self.text().units(enc, rng, sep)
