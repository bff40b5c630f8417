"""Data: tokenizers, text -> token shards, the shard reader, and the LightningDataModule.

The names below are imported on first use (PEP 562), not with the package: ``python -m
longctx.data.prepare`` (and ``synthesize``, ``convert``) imports this package before it runs the
module as ``__main__``, and a package that had imported the module already would hold a second
copy of it (Python's "found in sys.modules" RuntimeWarning). ``longctx.data.prepare`` is the
module; its function is ``longctx.data.prepare.prepare``.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "ByteTokenizer": "longctx.data.tokenizer",
    "DataConfig": "longctx.data.config",
    "HFTokenizer": "longctx.data.tokenizer",
    "LongCtxDataModule": "longctx.data.datamodule",
    "Manifest": "longctx.data.shards",
    "ShardSet": "longctx.data.shards",
    "Synthesized": "longctx.data.config",
    "Tokenizer": "longctx.data.tokenizer",
    "default_corpus_dir": "longctx.data.corpus",
    "load_manifest": "longctx.data.shards",
    "load_tokenizer": "longctx.data.tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found directly from now on
    return value
