"""Dense training tasks (``kv_recall``, ``copy``, ``repeat``): a needle per few hundred tokens,
placed at any token of a filler.

Each generator returns the layout of a document of ``length`` tokens: inserts only (no question,
no answer), which the synthesizer (longctx.data.synthesize) places between filler tokens.
"""

from __future__ import annotations

import random

from longctx.synthetic.layout import Layout
from longctx.synthetic.lc_formats import DIGITS, SPAN, keys, needle, number
from longctx.synthetic.pieces import cat

# a needle (and its question or repeat) per this many tokens of the document
KV_EVERY, COPY_EVERY = 256, 128


def kv_recall(rng: random.Random, enc, length: int) -> Layout:
    inserts = []
    for key in keys(rng, max(1, length // KV_EVERY)):
        value, at = number(rng, DIGITS), rng.random()
        prefix = f" The magic number for {key} is"
        question = cat(enc(f" What is the magic number for {key}?"), enc(prefix))
        inserts.append((at, needle(enc, prefix, value)))
        inserts.append((rng.uniform(at, 1.0), cat(question, enc(f" {value}"), enc(". "))))
    return Layout(inserts=inserts)


def copy(rng: random.Random, enc, length: int) -> Layout:
    inserts = []
    for _ in range(max(1, length // COPY_EVERY)):
        span = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(SPAN))
        piece = cat(enc(" Copy this:"), enc(f" {span}"), enc(". "))
        at = rng.random()
        inserts += [(at, piece), (rng.uniform(at, 1.0), piece)]
    return Layout(inserts=inserts)


def repeat(rng: random.Random, enc, length: int) -> Layout:
    """Random letters, then the same letters again: half the document is predictable by
    induction alone (the densest signal; no haystack, no template)."""
    span = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(max(4, length // 2 - 1)))
    piece = cat(enc(f"{span}\n"), enc(f"{span}\n"))
    return Layout(inserts=[(0.0, piece)])
