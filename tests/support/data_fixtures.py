"""Small prepared corpora and data modules for the data tests."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.prepare import prepare


def small_corpus(folder: Path, num_docs: int = 48, *, long_doc: int = 0) -> Path:
    rng = np.random.default_rng(0)
    texts = [
        "".join(rng.choice(list("abcdefgh "), size=int(n)))
        for n in rng.integers(5, 120, size=num_docs)
    ]
    if long_doc:
        texts[3] = "Z" * long_doc
    src = folder / "small.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([src], folder / "prepared", "byte", workers=1, val_fraction=0.0, progress=False)
    return folder / "prepared"


def take(dm: LongCtxDataModule, n: int) -> list:
    return list(itertools.islice(iter(dm.train_dataloader()), n))


def module(folder, **overrides) -> LongCtxDataModule:
    """One row per micro-batch unless ``overrides`` says otherwise (what the counts of the tests
    that use it are written for)."""
    dm = LongCtxDataModule(DataConfig(shards=[str(folder)], **{"micro_batch_size": 1, **overrides}))
    dm.setup("fit")
    return dm
