"""Data: tokenizers, text -> token shards, the shard reader, and the LightningDataModule."""

from longctx.data.config import DataConfig
from longctx.data.corpus import default_corpus_dir
from longctx.data.datamodule import LongCtxDataModule
from longctx.data.prepare import prepare
from longctx.data.shards import Manifest, ShardSet, load_manifest
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataConfig",
    "LongCtxDataModule",
    "HFTokenizer",
    "Manifest",
    "ShardSet",
    "Tokenizer",
    "default_corpus_dir",
    "load_manifest",
    "load_tokenizer",
    "prepare",
]
