"""Long-range training documents, seeded, written as a prepared folder (shards + manifest).

    python -m longctx.data.synthesize --tasks copy,kv_recall --out DIR --seed S \\
        [--documents N] [--min-length 64] [--max-length 1024] [--haystack embedded]

Every document is a retrieval the model can only do by reading back: its length is drawn
log-uniformly in [min, max] tokens, and its needles anywhere in it, so the distances from an
answer back to its needle reach the row length. Tasks (the registry's ``dense``, ``ood`` and
``lc`` families: longctx.synthetic.tasks):

- ``kv_recall`` (longctx.synthetic.dense): one key-value needle in the suite's niah format ("The magic number for
  quiet-river is 48213.") per ~256 tokens, and a question for each ("What is the magic number
  for quiet-river? The magic number for quiet-river is 48213.") somewhere after it: a dense
  signal, the eval's question format;
- ``copy``: one random-letter span per ~128 tokens ("Copy this: qwertyuiopas."), each repeated
  once somewhere after it, in the eval's copy format;
- ``repeat``: random letters, a newline, the same letters again (no haystack, no template): half
  the document predictable by induction alone, the densest signal there is;
- ``ood_ledger``, ``ood_locker``, ``ood_relay``, ``ood_echo``: dense retrieval whose templates,
  keys and values the suite never uses (longctx.synthetic.ood): the out-of-distribution mix;
- any ``lc_*`` task of longctx.synthetic (lc_niah_single, lc_passkey, lc_variable_tracking,
  ...; never RULER's templates, which the suite scores): one instance per document, answer
  included.

The documents of the tasks alternate (document i is task i mod T). The folder is a normal
prepared folder (its train split), so ``data.shards=[embedded, DIR]`` with ``data.weights``
mixes it with the embedded corpus. The weights choose sources per *document*: an embedded
chapter is ~3,600 tokens, so a token share needs the ratio of mean lengths (printed at the end).
A ``data.shards`` entry that names a mix by its settings (``Synthesized``) is synthesized into
the cache on first use (``synthesized_dir``).

Disjoint from what the suite evaluates: the haystack is the embedded corpus's *training*
chapters (the suite's default haystack is the held-out books, which no training row holds), and
every random choice comes from a stream named ``synthesize/<seed>/...`` (the suite's are named
``ruler/<task>/<seed>/...``), so no seed makes a training document equal to an evaluated one.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.cli import command
from longctx.data.cache import written_once
from longctx.data.config import Synthesized, check_mix_settings
from longctx.data.corpus import resolve_haystack
from longctx.data.shards import (
    Manifest,
    SplitInfo,
    SplitWriter,
    load_manifest,
    require_new_folder,
    settings_digest,
    write_generated,
)
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import LongctxError
from longctx.synthetic import DoesNotFit, Encoder, TaskInputError
from longctx.synthetic.tasks import TASKS, training_tokens

KIND = "synthesize"
VERSION = 1
SHARD_TOKENS = 1 << 24


def document(name: str, index: int, seed: int, tokenizer, lengths, haystack) -> np.ndarray:
    """Training document ``index`` of task ``name`` (ending in EOS)."""
    rng = random.Random(f"{KIND}/{seed}/{name}/{index}")
    low, high = lengths
    length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    try:
        tokens = training_tokens(TASKS[name], rng, Encoder(tokenizer), length, high, haystack)
    except DoesNotFit:
        raise TaskInputError(f"{name} does not fit --max-length {high}; raise it") from None
    return np.append(tokens, tokenizer.eos_id).astype(np.int64)


def synthesize(
    tasks: Sequence[str] | str,
    out: str | Path,
    seed: int = 0,
    documents: int = 2000,
    min_length: int = 64,
    max_length: int = 1024,
    haystack: str = "embedded",
    tokenizer="byte",
    cache_dir: str | None = None,
) -> Manifest:
    """Write ``documents`` per task into ``out`` (new or empty); see the module docstring. The
    folder appears whole or not at all: a refusal midway (a task that does not fit
    ``max_length``) or a crash leaves nothing behind."""
    names = check_mix_settings(tasks, seed, documents, min_length, max_length)
    require_new_folder(Path(out))  # before the haystack, which may be prepared first
    tok = load_tokenizer(tokenizer)
    source = resolve_haystack(haystack, cache_dir)
    options = {
        "kind": KIND, "version": VERSION, "tasks": names, "seed": seed, "documents": documents,
        "min_length": min_length, "max_length": max_length,
        "haystack": getattr(source, "name", str(haystack)), "tokenizer": tok.spec,
    }  # fmt: skip

    def write_splits(folder: Path, dtype: str) -> dict[str, SplitInfo]:
        writer = SplitWriter(folder, "train-00000", dtype, SHARD_TOKENS)
        for i in range(documents * len(names)):
            name = names[i % len(names)]
            writer.add(document(name, i // len(names), seed, tok, (min_length, max_length), source))
        return {"train": writer.close(), "val": SplitInfo()}

    return write_generated(out, options, tok, write_splits)


def holds_only_training_haystacks(folder: str | Path | Synthesized) -> bool:
    """True for a folder this module wrote from the embedded training chapters or noise (or a
    data.shards entry naming one by its settings): its documents share no text with the
    embedded corpus's held-out books."""
    if isinstance(folder, Synthesized):
        return folder.haystack in ("embedded", "noise")
    try:
        sources = load_manifest(folder).sources
    except (FileNotFoundError, LongctxError):  # not a prepared folder: the reader will say so
        return False
    return bool(sources) and all(
        s.get("kind") == KIND and s.get("haystack") in ("embedded", "noise") for s in sources
    )


def synthesized_dir(
    spec: Synthesized, cache_dir: str | Path | None = None, default_tokenizer: str | None = None
) -> Path:
    """The folder of a synthesized mix (a ``data.shards`` entry named by its settings) in the
    cache, synthesized once (under a lock) if needed. Its name is a digest of the settings and
    of the generator's version: the same settings find it again, changed ones get another.
    ``default_tokenizer``: the run's (data.tokenizer), for a spec that names none."""
    spec = dataclasses.replace(spec, tokenizer=spec.tokenizer or default_tokenizer or "byte")
    settings = dataclasses.asdict(spec) | {"version": VERSION}
    digest = settings_digest(settings)[:12]
    name = f"synthesized_L{spec.min_length}-{spec.max_length}_s{spec.seed}_{digest}"

    def write(out: Path) -> None:
        try:
            manifest = synthesize(
                spec.tasks, out, spec.seed, spec.documents, spec.min_length,
                spec.max_length, spec.haystack, spec.tokenizer,
                None if cache_dir is None else str(cache_dir),
            )  # fmt: skip
        except LongctxError as err:  # the mix's settings, in the terms of the config
            raise LongctxError(f"data.shards: the synthesized mix {settings}: {err}") from err
        train = manifest.splits["train"]
        print(
            f"synthesized {train.documents} documents ({', '.join(spec.tasks)}; seed "
            f"{spec.seed}, {spec.min_length}..{spec.max_length} tokens, {train.tokens} in "
            f"all) into {out}",
            flush=True,
        )

    return written_once(cache_dir, name, write, lambda out: _check_synthesized(out, settings))


def _check_synthesized(folder: Path, settings: dict) -> None:
    """The folder's manifest records the settings its name stands for (never a stale mix)."""
    recorded = load_manifest(folder).sources
    keys = ("version", "tasks", "seed", "documents", "min_length", "max_length")
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if len(recorded) != 1 or any(recorded[0].get(k) != expected[k] for k in keys):
        raise LongctxError(
            f"{folder} holds documents synthesized with other settings ({recorded}); expected "
            f"{ {k: expected[k] for k in keys} }: remove the folder to synthesize it again"
        )


def main(argv: Sequence[str] | None = None) -> Manifest:
    p = argparse.ArgumentParser(
        prog="python -m longctx.data.synthesize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", required=True, help="comma-separated: kv_recall,copy,niah_single...")
    p.add_argument("--out", required=True, type=Path, help="a new or empty folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--documents", type=int, default=2000, help="documents per task")
    p.add_argument("--min-length", type=int, default=64, help="tokens of the shortest document")
    p.add_argument("--max-length", type=int, default=1024, help="tokens of the longest (the row)")
    p.add_argument("--haystack", default="embedded",
                   help="embedded (its training chapters), noise, or a prepared folder")  # fmt: skip
    p.add_argument("--tokenizer", default="byte", help="'byte', 'llama3' or a tokenizer folder")
    p.add_argument("--cache-dir", default=None, help="where the embedded corpus is prepared")
    args = p.parse_args(argv)
    manifest = synthesize(
        args.tasks, args.out, args.seed, args.documents, args.min_length, args.max_length,
        args.haystack, args.tokenizer, args.cache_dir,
    )  # fmt: skip
    train = manifest.splits["train"]
    print(
        f"{args.out}: {train.documents} documents, {train.tokens} tokens ({manifest.dtype}), "
        f"{train.tokens / train.documents:.0f} per document (data.weights are per document)"
    )
    return manifest


cli = command(main)  # python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
