"""Keys and values as RULER draws them.

- ``words``: an adjective-noun pair ``adj-noun`` from the ``wonderwords`` package's
  adjectivelist.txt and nounlist.txt (read from the installed package, never downloaded):
  adjective and noun drawn uniformly, so the pair is uniform over their product;
- ``numbers``: 7 digits, uniform in [1,000,000, 9,999,999];
- ``uuids``: ``uuid.UUID(int=getrandbits(128), version=4)``.

``common_words``: RULER's common-words vocabulary, nouns + adjectives + verbs, sorted and
de-duplicated.
"""

from __future__ import annotations

import functools
import importlib.resources
import random
import uuid


@functools.cache
def wordlist(name: str) -> tuple[str, ...]:
    """One of wonderwords' lists (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``)."""
    text = (importlib.resources.files("wonderwords") / "assets" / name).read_text("utf-8")
    return tuple(sorted({w.strip() for w in text.splitlines() if w.strip()}))


@functools.cache
def common_words() -> tuple[str, ...]:
    names = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    return tuple(sorted({w for n in names for w in wordlist(n)}))


def draw(rng: random.Random, kind: str) -> str:
    """One key or value of ``kind``: words, numbers or uuids."""
    if kind == "words":
        return f"{rng.choice(wordlist('adjectivelist.txt'))}-{rng.choice(wordlist('nounlist.txt'))}"
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown value kind {kind!r}")


def distinct(rng: random.Random, kind: str, count: int, avoid: frozenset[str] = frozenset()):
    """``count`` different draws of ``kind``, none in ``avoid``."""
    out: list[str] = []
    while len(out) < count:
        item = draw(rng, kind)
        if item not in out and item not in avoid:
            out.append(item)
    return out
