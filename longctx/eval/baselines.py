"""Reference losses a trained model must beat."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from longctx.data.shards import ShardSet
from longctx.errors import LongctxError


def unigram_cross_entropy(
    train_docs: Iterable[np.ndarray], eval_docs: Iterable[np.ndarray], vocab_size: int
) -> float:
    """Cross-entropy (nats/token) of the train split's unigram distribution on eval targets.

    Targets are what the model is scored on: every token of a document but its first (nothing
    predicts a document's first token across a boundary). Add-one smoothing keeps unseen ids finite.
    """
    counts = np.ones(vocab_size, dtype=np.float64)
    for doc in train_docs:
        counts += np.bincount(doc, minlength=vocab_size)
    log_p = np.log(counts / counts.sum())
    total, n = 0.0, 0
    for doc in eval_docs:
        total -= float(log_p[doc[1:]].sum())
        n += len(doc) - 1
    if n == 0:
        raise LongctxError("unigram_cross_entropy: the eval documents hold no targets")
    return total / n


def unigram_baseline(folder: str | Path) -> float:
    """The unigram cross-entropy of a prepared folder: its train split's distribution scored on
    its val split (nats/token)."""
    train, val = ShardSet(folder, "train"), ShardSet(folder, "val")
    docs = lambda shards: (shards.document(i) for i in range(len(shards)))  # noqa: E731
    return unigram_cross_entropy(docs(train), docs(val), train.manifest.vocab_size)
