"""The tokenizer of a run is the tokenizer of its data.

A run's ids are what its prepared folders hold, so its tokenizer is the one their manifests
state (they must all state the same one). ``data.tokenizer`` only names the tokenizer the
embedded corpus and synthesized mixes are prepared with on first use; when it is set, every
folder must have been prepared with it. Training (the DataModule), eval, export and verify all
ask :func:`run_tokenizer`, so an export carries the tokenizer its model was trained with.
"""

from __future__ import annotations

from pathlib import Path

from longctx.data.config import DataConfig, MqarCorpus, Synthesized
from longctx.data.corpus import EMBEDDED, default_corpus_dir
from longctx.data.mqar_corpus import mqar_dir
from longctx.data.shards import load_manifest
from longctx.data.synthesize import synthesized_dir
from longctx.data.tokenizer import data_tokenizer
from longctx.errors import LongctxError


def data_folders(config: DataConfig) -> list[Path]:
    """The prepared folders a run reads: data.shards (the name ``embedded`` is the embedded
    corpus, a Synthesized entry a synthesized mix), or the embedded corpus alone (both
    prepared on first use)."""
    if config.shards is not None and not config.shards:
        raise LongctxError("DataConfig.shards=[]; expected prepared folders or None")
    entries = [EMBEDDED] if config.shards is None else config.shards
    return [shard_folder(entry, config.cache_dir, config.tokenizer) for entry in entries]


def shard_folder(entry, cache_dir: str | Path | None = None, tokenizer: str | None = None) -> Path:
    """The prepared folder of one ``data.shards`` entry: the name ``embedded`` is the embedded
    corpus, a Synthesized entry a synthesized mix, an MqarCorpus an MQAR corpus (each prepared
    on first use), anything else a folder. ``tokenizer``: the run's data.tokenizer."""
    if isinstance(entry, Synthesized):
        return synthesized_dir(entry, cache_dir, default_tokenizer=tokenizer)
    if isinstance(entry, MqarCorpus):
        return mqar_dir(entry, cache_dir)
    if entry == EMBEDDED:
        return default_corpus_dir(cache_dir, tokenizer=tokenizer)
    return Path(entry)


def run_tokenizer(config: DataConfig) -> dict:
    """The manifest spec of the run's tokenizer (see the module docstring)."""
    folders = data_folders(config)
    return data_tokenizer(config.tokenizer, folders, [load_manifest(f) for f in folders])
