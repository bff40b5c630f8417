"""Token pieces: every piece an answer repeats is encoded on its own, so its tokens are the same
wherever it occurs, under any tokenizer (a BPE merges across a boundary only within a piece)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from longctx.errors import LongctxError

_MEMO_LIMIT = 1 << 20  # pieces remembered per encoder (haystack sentences recur across instances)


class TaskInputError(LongctxError):
    """Bad input to a task (a name, length, depth, haystack or data folder): the message says
    which value and what to do."""


class DoesNotFit(ValueError):
    """A task cannot be laid out in the given length: too short for it."""


class RunsOut(DoesNotFit):
    """A task cannot be laid out in the given length: its material (qa documents, cwe's
    vocabulary) ends first."""


class Encoder:
    """``tokenizer.encode`` as int64 arrays, memoised per text (read-only arrays)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        ids = self._memo.get(text)
        if ids is None:
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
            ids.setflags(write=False)
            self._memo[text] = ids
        return ids


def cat(*pieces: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(0, np.int64), *pieces]).astype(np.int64)


def listing(enc: Encoder, items: Sequence[str], sep: str = ",") -> np.ndarray:
    """``" a, b, c"`` with every item encoded alone as ``" item"`` (as in its needle)."""
    pieces: list[np.ndarray] = []
    for i, item in enumerate(items):
        pieces += [enc(sep), enc(f" {item}")] if i else [enc(f" {item}")]
    return cat(*pieces)
