"""Long-range training documents, seeded, written as a prepared folder (shards + manifest).

    python -m longctx.data.synthesize --tasks copy,kv_recall --out DIR --seed S \\
        [--documents N] [--min-length 64] [--max-length 1024] [--haystack embedded]

Every document is a retrieval the model can only do by reading back: its length is drawn
log-uniformly in [min, max] tokens, and its needles anywhere in it, so the distances from an
answer back to its needle reach the row length. Tasks:

- ``kv_recall``: one key-value needle in the suite's niah format ("The magic number for
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

Disjoint from what the suite evaluates: the haystack is the embedded corpus's *training*
chapters (the suite's default haystack is the held-out books, which no training row holds), and
every random choice comes from a stream named ``synthesize/<seed>/...`` (the suite's are named
``ruler/<task>/<seed>/...``), so no seed makes a training document equal to an evaluated one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from longctx.cli import command
from longctx.data.config import Synthesized
from longctx.data.haystack import resolve_haystack
from longctx.data.shards import FORMAT_VERSION, Manifest, SplitWriter, load_manifest, write_manifest
from longctx.data.tokenizer import load_tokenizer
from longctx.synthetic import DoesNotFit, Encoder, Layout, assemble, ood
from longctx.synthetic import TaskInputError as RulerInputError
from longctx.synthetic import cat as _cat
from longctx.synthetic.legacy import DIGITS, SPAN
from longctx.synthetic.legacy import keys as _keys
from longctx.synthetic.legacy import needle as _needle
from longctx.synthetic.legacy import number as _number
from longctx.synthetic.tasks import TASKS, check_names, lay_out

KIND = "synthesize"
VERSION = 1
# the dense tasks: a needle (and its question or repeat) per this many tokens of the document
KV_EVERY, COPY_EVERY = 256, 128
SHARD_TOKENS = 1 << 24


# ------------------------------------------------------------------------ dense tasks
def kv_recall(rng: random.Random, enc, length: int) -> Layout:
    count = max(1, length // KV_EVERY)
    keys = _keys(rng, count)
    inserts = []
    for key in keys:
        value, at = _number(rng, DIGITS), rng.random()
        prefix = f" The magic number for {key} is"
        question = _cat(enc(f" What is the magic number for {key}?"), enc(prefix))
        inserts.append((at, _needle(enc, prefix, value)))
        inserts.append((rng.uniform(at, 1.0), _cat(question, enc(f" {value}"), enc(". "))))
    return Layout(inserts=inserts)


def copy_dense(rng: random.Random, enc, length: int) -> Layout:
    inserts = []
    for _ in range(max(1, length // COPY_EVERY)):
        span = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(SPAN))
        piece = _cat(enc(" Copy this:"), enc(f" {span}"), enc(". "))
        at = rng.random()
        inserts += [(at, piece), (rng.uniform(at, 1.0), piece)]
    return Layout(inserts=inserts)


def repeat(rng: random.Random, enc, length: int) -> Layout:
    """Random letters, then the same letters again: half the document is predictable by
    induction alone (the densest signal; no haystack, no template)."""
    span = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(max(4, length // 2 - 1)))
    piece = _cat(enc(f"{span}\n"), enc(f"{span}\n"))
    return Layout(inserts=[(0.0, piece)])


DENSE = {"kv_recall": kv_recall, "copy": copy_dense, "repeat": repeat}


def check_tasks(names: Sequence[str] | str) -> list[str]:
    """The training tasks: the dense ones and the suite's (None is no task: refused)."""
    known = [*DENSE, *ood.TASKS, *(t for t in TASKS if not TASKS[t].ruler)]
    return check_names([] if names is None else names, known)


# -------------------------------------------------------------------------- documents
def document(name: str, index: int, seed: int, tokenizer, lengths, haystack) -> np.ndarray:
    """Training document ``index`` of task ``name`` (ending in EOS)."""
    rng = random.Random(f"{KIND}/{seed}/{name}/{index}")
    low, high = lengths
    length = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    enc = Encoder(tokenizer)
    if name in ood.TASKS:  # the suite's formats nowhere (longctx.synthetic.ood)
        tokens, _ = ood.document(name, rng, enc, length - 1, haystack.units(enc, rng, " "))
        if len(tokens) >= high:
            raise RulerInputError(f"{name} does not fit --max-length {high}; raise it")
    elif name in DENSE:
        layout = DENSE[name](rng, enc, length)
        if layout.fixed_tokens > high:
            raise RulerInputError(f"{name} does not fit --max-length {high}; raise it")
        length = max(length, layout.fixed_tokens)  # a short draw still holds one needle
        filler = haystack.tokens(enc, rng, length)  # needles at any token, not per sentence
        tokens = assemble(layout, length, (filler[i : i + 1] for i in range(length))).prompt
    else:
        tokens = _instance_tokens(TASKS[name], tokenizer, length, high, rng, haystack)
    return np.append(tokens, tokenizer.eos_id).astype(np.int64)


def _instance_tokens(spec, tokenizer, length: int, longest: int, rng, haystack) -> np.ndarray:
    """A suite instance at ``length`` or, when that is too short for it, the next doubling."""
    depth = rng.random()
    while True:
        try:
            layout, laid = lay_out(spec, Encoder(tokenizer), length, depth, rng, haystack)
            return np.concatenate([laid.prompt, layout.answer])
        except DoesNotFit:
            if length >= longest:
                raise RulerInputError(
                    f"{spec.name} does not fit --max-length {longest}; raise it"
                ) from None
            length = min(2 * length, longest)


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
    names = check_settings(tasks, seed, documents, min_length, max_length)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RulerInputError(
            f"--out is not a new or empty folder ({out}); choose another, synthesize never "
            "writes among other files"
        )
    tok = load_tokenizer(tokenizer)
    source = resolve_haystack(haystack, cache_dir)
    options = {
        "kind": KIND, "version": VERSION, "tasks": names, "seed": seed, "documents": documents,
        "min_length": min_length, "max_length": max_length,
        "haystack": getattr(source, "name", str(haystack)), "tokenizer": tok.spec,
    }  # fmt: skip
    with staged_folder(out) as folder:
        return _write(folder, options, tok, source)


def _write(folder: Path, options: dict, tok, source) -> Manifest:
    names, seed, lengths = (
        options["tasks"],
        options["seed"],
        (options["min_length"], options["max_length"]),
    )
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32).name
    writer = SplitWriter(folder, "train-00000", dtype, SHARD_TOKENS)
    for i in range(options["documents"] * len(names)):
        name = names[i % len(names)]
        writer.add(document(name, i // len(names), seed, tok, lengths, source))
    manifest = Manifest(
        input_hash=hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest(),
        tokenizer=tok.spec,
        vocab_size=int(tok.vocab_size),
        eos_id=int(tok.eos_id),
        pad_id=int(tok.pad_id),
        dtype=dtype,
        val_fraction=0.0,
        sources=[options],
        splits={"train": writer.close(), "val": SplitWriter(folder, "val", dtype, 1).close()},
        format_version=FORMAT_VERSION,
    )
    write_manifest(folder, manifest)
    return manifest


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A new folder beside ``out``, renamed to ``out`` (new or empty) when the block completes;
    removed, with the parent folders made for it, when the block raises."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # innermost first
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # as a plain mkdir would (mkdtemp makes it private)
    try:
        yield stage
        os.rename(stage, out)  # onto an empty folder too (POSIX)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for parent in made:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def check_settings(tasks, seed, documents, min_length, max_length) -> list[str]:
    """The task names, once the settings are ones synthesize can use (else one line naming the
    value)."""
    names = check_tasks(tasks)
    for name, value, least in (("seed", seed, 0), ("documents", documents, 1),
                               ("min_length", min_length, 2)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise RulerInputError(f"{name}={value!r}; expected an int >= {least}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < min_length:
        raise RulerInputError(
            f"max_length={max_length!r}; expected an int >= min_length={min_length}"
        )
    return names


def holds_only_training_haystacks(folder: str | Path | Synthesized) -> bool:
    """True for a folder this module wrote from the embedded training chapters or noise (or a
    data.shards entry naming one by its settings): its documents share no text with the
    embedded corpus's held-out books."""
    if isinstance(folder, Synthesized):
        return folder.haystack in ("embedded", "noise")
    try:
        sources = load_manifest(folder).sources
    except (FileNotFoundError, ValueError):  # not a prepared folder: the reader will say so
        return False
    return bool(sources) and all(
        s.get("kind") == KIND and s.get("haystack") in ("embedded", "noise") for s in sources
    )


# --------------------------------------------------------------------------------- CLI
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
