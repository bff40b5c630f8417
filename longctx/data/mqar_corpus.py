"""MQAR documents (``longctx.synthetic.mqar``) written as a prepared folder: a token source the
data pipeline reads like any prepared corpus, with no text tokenizer in between.

    python -m longctx.data.mqar_corpus --out DIR --documents N --seed S \\
        [--keys 512] [--values 512] [--min-pairs 2] [--max-pairs 32] [--slot-ratio 1.5]

The manifest's tokenizer is ``{"kind": "mqar", ...}``: the synthetic vocabulary (filler 0,
EOS 1, the keys, then the values) and the document distribution, so a run trained on it is
known by what its tokens mean. Every document ends with EOS. Train with
``data=shards data.shards=[DIR] data.loss_tokens=answers``: the loss then counts the answers
only (the value after each query), as Zoology trains MQAR. A ``data.shards`` entry
``{mqar: {...}}`` (``MqarCorpus``) is written into the cache on first use (``mqar_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.cli import command
from longctx.data.cache import written_once
from longctx.data.config import MqarCorpus, check_counts
from longctx.data.shards import (
    Manifest,
    SplitInfo,
    SplitWriter,
    Vocabulary,
    load_manifest,
    settings_digest,
    write_generated,
)
from longctx.errors import LongctxError
from longctx.synthetic.mqar import EOS, FILLER, KIND, MqarSpec, MqarVocab, tokenizer_spec

SHARD_TOKENS = 1 << 24
# the corpus's random streams are [seed, STREAM, split]: the held-out instances of
# studies.recall_conditions draw from streams of their own, never these
STREAM = 0x6D716172


def write_corpus(
    out: str | Path, spec: MqarSpec, documents: int, seed: int, val_documents: int = 200
) -> Manifest:
    """``documents`` training and ``val_documents`` validation documents of ``spec`` drawn from
    ``seed`` into ``out`` (new or empty; it appears whole or not at all)."""
    check_counts(documents, seed, val_documents)
    options = {
        "kind": KIND, "spec": dataclasses.asdict(spec), "documents": documents, "seed": seed,
        "val_documents": val_documents,
    }  # fmt: skip
    vocab = Vocabulary(spec.vocab.size, EOS, FILLER, tokenizer_spec(spec))

    def write_splits(folder: Path, dtype: str) -> dict[str, SplitInfo]:
        counts = (("train", "train-00000", documents), ("val", "val", val_documents))
        splits = {}
        for i, (split, stem, count) in enumerate(counts):
            writer = SplitWriter(folder, stem, dtype, SHARD_TOKENS)
            rng = np.random.default_rng([seed, STREAM, i])
            for _ in range(count):
                writer.add(spec.document(rng).tokens)
            splits[split] = writer.close()
        return splits

    return write_generated(out, options, vocab, write_splits)


def mqar_dir(corpus: MqarCorpus, cache_dir: str | Path | None = None) -> Path:
    """The folder of an MQAR corpus (a ``data.shards`` entry named by its settings) in the
    cache, written once (under a lock) if needed."""
    name = f"mqar_s{corpus.seed}_{settings_digest(dataclasses.asdict(corpus))[:12]}"

    def write(out: Path) -> None:
        manifest = write_corpus(
            out, corpus.spec(), corpus.documents, corpus.seed, corpus.val_documents
        )
        train = manifest.splits["train"]
        print(f"wrote {train.documents} MQAR documents ({train.tokens} tokens) into {out}")

    def check(out: Path) -> None:
        recorded = load_manifest(out).sources
        if len(recorded) != 1 or recorded[0].get("spec") != dataclasses.asdict(corpus.spec()):
            raise LongctxError(f"{out} holds another MQAR corpus ({recorded}); remove it")

    return written_once(cache_dir, name, write, check)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m longctx.data.mqar_corpus", description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--documents", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-documents", type=int, default=200)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--values", type=int, default=512)
    parser.add_argument("--min-pairs", type=int, default=2)
    parser.add_argument("--max-pairs", type=int, default=32)
    parser.add_argument("--slot-ratio", type=float, default=1.5)
    args = parser.parse_args(argv)
    spec = MqarSpec(
        MqarVocab(args.keys, args.values), args.min_pairs, args.max_pairs, args.slot_ratio
    )
    manifest = write_corpus(args.out, spec, args.documents, args.seed, args.val_documents)
    train = manifest.splits["train"]
    print(f"wrote {args.out}: {train.documents} documents, {train.tokens} tokens")


cli = command(main)

if __name__ == "__main__":
    cli()
