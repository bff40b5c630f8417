"""Reference losses a trained model must beat."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


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
        raise ValueError("unigram_cross_entropy: the eval documents hold no targets")
    return total / n
