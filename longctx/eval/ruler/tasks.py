"""The suite's tasks, modelled on RULER's synthetic set (Hsieh et al. 2024), all teacher-forced.

Each task draws its needles, question and answer from the instance's rng (``Layout``); the
haystack fills the rest of the length. Pieces that the answer repeats (a value, a key, a span)
are encoded on their own, so the answer's tokens equal the needle's under any tokenizer.

- ``passkey``: "The pass key is 48213. Remember it." ... "What is the pass key? The pass key is"
- ``niah_single``: one key-value needle ("The magic number for quiet-river is 48213."), asked by key
- ``niah_multikey``: the target needle among three with other keys
- ``niah_multivalue``: four values for one key; the answer lists them in order of appearance
- ``niah_multiquery``: four keys asked at once; the answer lists their values in the asked order
- ``variable_tracking``: a chain "VAR ABCDE = 48213." "VAR FGHIJ = VAR ABCDE." ... (four hops)
  among a distractor chain; the answer names the chain in order
- ``common_words``: a word list (no haystack) where five words appear more often than any other;
  the answer lists them in order of first appearance
- ``frequent_words``: coded words with Zipf counts (no haystack); the three most frequent, most first
- ``copy``: a span of random letters seen once and repeated at a distance: the repeat is scored,
  and the first occurrence (which nothing predicts) is scored too as its reference

``depth`` places the (first) needle, the first assignment or the first occurrence; a task
without a haystack ignores it apart from the instance's seed.
"""

from __future__ import annotations

import dataclasses
import math
import random
import string
from collections.abc import Callable

import numpy as np

from longctx.eval.ruler.instances import Layout

DIGITS = 5  # digits of a passkey / magic number
NEEDLES = 4  # needles of the multi-key / multi-value / multi-query tasks, hops of the chain
COMMON = 5  # common_words: the words to find
TOP = 3  # frequent_words: the words to find
CODED_VOCAB = 20  # frequent_words: distinct coded words per instance
SPAN = 12  # copy: letters of the span

# keys, list words: short plain words (two joined by a hyphen make a key)
_WORD_LIST = """
    apple arrow autumn badge baker banner barrel basket beacon berry blanket bottle branch
    breeze bridge bucket butter button cabin camera candle canyon carpet castle cedar chalk
    cherry circle cliff clock cloud clover cobalt coffee copper corner cotton crayon crystal
    current curtain daisy desert dinner dolphin domino dragon drum eagle echo ember engine
    falcon feather fence fern fiddle field flame forest fossil fountain garden garnet ginger
    glacier glove granite guitar hammer harbor harvest hazel helmet hollow honey horizon island
    ivory jacket jasmine jungle kettle kitten ladder lantern lemon letter lily linen lizard
    magnet maple marble meadow melon mirror monkey mountain muffin napkin needle nickel noodle
    oasis ocean olive orbit orchid otter paddle painter panda paper parrot pebble pencil pepper
    piano pillow pirate planet pocket pony puzzle quartz quill rabbit radar raven ribbon river
    rocket saddle salmon satin shadow shell silver sketch socket spider spoon spring squash
    stable star stone sugar summit sunset tablet temple thistle thunder ticket tiger timber
    toast tomato topaz tower trumpet tulip tunnel turtle umbrella valley velvet violet wagon
    walnut whistle willow window winter wizard yarrow zebra zephyr
"""
WORDS = tuple(_WORD_LIST.split())


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's generator, its chance level and whether it reads a haystack."""

    name: str
    build: Callable[..., Layout]  # (rng, encode, budget, depth, digits) -> Layout
    chance: Callable[[int], float]  # digits -> accuracy of a context-free guess
    uses_haystack: bool = True


# ----------------------------------------------------------------------------- pieces
def _number(rng: random.Random, digits: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(digits))


def _keys(rng: random.Random, count: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _cat(*pieces: np.ndarray) -> np.ndarray:
    return np.concatenate(pieces).astype(np.int64)


def _listing(enc, items: list[str]) -> np.ndarray:
    """ " a, b, c" with every item encoded alone (so the needles' tokens recur unchanged)."""
    pieces = []
    for i, item in enumerate(items):
        pieces += [enc(","), enc(f" {item}")] if i else [enc(f" {item}")]
    return _cat(*pieces)


def _needle(enc, prefix: str, value: str) -> np.ndarray:
    return _cat(enc(prefix), enc(f" {value}"), enc(". "))


# ------------------------------------------------------------------------------ tasks
def passkey(rng, enc, budget, depth, digits) -> Layout:
    key = _number(rng, digits)
    return Layout(
        inserts=[(depth, enc(f" The pass key is {key}. Remember it. "))],
        question=enc(" What is the pass key? The pass key is"),
        answer=enc(f" {key}"),
        answer_text=key,
    )


def niah_single(rng, enc, budget, depth, digits) -> Layout:
    return _niah(rng, enc, depth, digits, distractors=0)


def niah_multikey(rng, enc, budget, depth, digits) -> Layout:
    return _niah(rng, enc, depth, digits, distractors=NEEDLES - 1)


def _niah(rng, enc, depth, digits, distractors: int) -> Layout:
    keys = _keys(rng, 1 + distractors)
    values = [_number(rng, digits) for _ in keys]
    depths = [depth] + [rng.random() for _ in range(distractors)]
    prefix = " The magic number for {} is"
    return Layout(
        inserts=[
            (d, _needle(enc, prefix.format(k), v))
            for d, k, v in zip(depths, keys, values, strict=True)
        ],
        question=_cat(
            enc(f" What is the magic number for {keys[0]}?"), enc(prefix.format(keys[0]))
        ),
        answer=enc(f" {values[0]}"),
        answer_text=values[0],
    )


def niah_multivalue(rng, enc, budget, depth, digits) -> Layout:
    key = _keys(rng, 1)[0]
    values = [_number(rng, digits) for _ in range(NEEDLES)]
    depths = [depth] + [rng.random() for _ in range(NEEDLES - 1)]
    in_order = [v for _, v in sorted(zip(depths, values, strict=True), key=lambda dv: dv[0])]
    return Layout(
        inserts=[
            (d, _needle(enc, f" A magic number for {key} is", v))
            for d, v in zip(depths, values, strict=True)
        ],
        question=enc(f" What are all the magic numbers for {key}? The magic numbers for {key} are"),
        answer=_listing(enc, in_order),
        answer_text=", ".join(in_order),
    )


def niah_multiquery(rng, enc, budget, depth, digits) -> Layout:
    keys = _keys(rng, NEEDLES)
    values = [_number(rng, digits) for _ in keys]
    depths = [depth] + [rng.random() for _ in range(NEEDLES - 1)]
    asked = list(range(NEEDLES))
    rng.shuffle(asked)
    names = [keys[i] for i in asked]
    prefix = " The magic number for {} is"
    return Layout(
        inserts=[
            (d, _needle(enc, prefix.format(k), v))
            for d, k, v in zip(depths, keys, values, strict=True)
        ],
        question=enc(
            f" What are the magic numbers for {', '.join(names[:-1])} and {names[-1]}? They are"
        ),  # fmt: skip
        answer=_listing(enc, [values[i] for i in asked]),
        answer_text=", ".join(values[i] for i in asked),
    )


def variable_tracking(rng, enc, budget, depth, digits) -> Layout:
    names: list[str] = []
    while len(names) < 2 * NEEDLES:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    chain, other = names[:NEEDLES], names[NEEDLES:]
    value, other_value = _number(rng, digits), _number(rng, digits)
    while other_value == value:
        other_value = _number(rng, digits)
    chain_depths = [depth + (1 - depth) * i / NEEDLES for i in range(NEEDLES)]
    other_depths = sorted(rng.random() for _ in range(NEEDLES))
    inserts = []
    for names_, first, depths in ((chain, value, chain_depths), (other, other_value, other_depths)):
        for i, (d, name) in enumerate(zip(depths, names_, strict=True)):
            source = first if i == 0 else f"VAR {names_[i - 1]}"
            inserts.append((d, _cat(enc(f" VAR {name} ="), enc(f" {source}"), enc(". "))))
    return Layout(
        inserts=inserts,
        question=enc(f" Which variables are assigned the value {value}? They are"),
        answer=_listing(enc, chain),
        answer_text=", ".join(chain),
    )


def common_words(rng, enc, budget, depth, digits) -> Layout:
    words = list(WORDS)
    rng.shuffle(words)
    common, pool = words[:COMMON], words[COMMON:]
    question = enc(f" What are the {COMMON} most common words in the list above? They are")
    answer_len = len(_listing(enc, common))  # the same in any order: items are encoded alone
    pieces = {w: _cat(enc(f" {w}"), enc(",")) for w in words}
    room = budget - len(question) - answer_len - len(enc(" Words:"))
    widest = max(len(p) for p in pieces.values())
    entries = room // widest
    # half the entries are the common words: each appears more often than any other word
    count = max(2, entries // (2 * COMMON))
    rest = entries - COMMON * count
    repeats = math.ceil(rest / len(pool)) if rest > 0 else 0
    if rest < 0 or count <= repeats:
        raise _too_short("common_words", budget)
    items = common * count + (pool * repeats)[:rest]
    rng.shuffle(items)
    first_seen = sorted(common, key=items.index)
    return Layout(
        inserts=[(1.0, _cat(enc(" Words:"), *(pieces[w] for w in items)))],
        question=question,
        answer=_listing(enc, first_seen),
        answer_text=", ".join(first_seen),
    )


def frequent_words(rng, enc, budget, depth, digits) -> Layout:
    coded: list[str] = []
    while len(coded) < CODED_VOCAB:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        if word not in coded:
            coded.append(word)
    question = enc(f" What are the {TOP} most frequent coded words in the text above? They are")
    answer_len = len(_listing(enc, coded[:TOP]))
    pieces = {w: enc(f" {w}") for w in coded}
    room = budget - len(question) - answer_len - len(enc(" Coded text:"))
    entries = room // max(len(p) for p in pieces.values())
    harmonic = sum(1 / r for r in range(1, CODED_VOCAB + 1))
    counts = [max(1, int(entries / (r * harmonic))) for r in range(1, CODED_VOCAB + 1)]
    if sum(counts) > entries or not counts[0] > counts[1] > counts[2] > counts[3]:
        raise _too_short("frequent_words", budget)
    items = [w for w, c in zip(coded, counts, strict=True) for _ in range(c)]
    rng.shuffle(items)
    return Layout(
        inserts=[(1.0, _cat(enc(" Coded text:"), *(pieces[w] for w in items)))],
        question=question,
        answer=_listing(enc, coded[:TOP]),
        answer_text=", ".join(coded[:TOP]),
    )


def copy(rng, enc, budget, depth, digits) -> Layout:
    span = "".join(rng.choice(string.ascii_lowercase) for _ in range(SPAN))
    cue, body = enc(" Copy this:"), enc(f" {span}")
    return Layout(
        inserts=[(depth, _cat(cue, body, enc(". ")))],
        question=cue,
        answer=body,
        answer_text=span,
        reference=(0, len(cue), len(cue) + len(body)),
    )


class _TooShort(ValueError):
    pass


def _too_short(task: str, budget: int) -> _TooShort:
    return _TooShort(f"{task}: {budget} tokens do not hold a word list with a clear answer")


TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("passkey", passkey, lambda d: 10.0**-d),
        Task("niah_single", niah_single, lambda d: 10.0**-d),
        Task("niah_multikey", niah_multikey, lambda d: 10.0**-d),
        Task("niah_multivalue", niah_multivalue, lambda d: 10.0 ** -(NEEDLES * d)),
        Task("niah_multiquery", niah_multiquery, lambda d: 10.0 ** -(NEEDLES * d)),
        Task("variable_tracking", variable_tracking, lambda d: 26.0 ** -(5 * NEEDLES)),
        Task("common_words", common_words, lambda d: 1 / math.perm(len(WORDS), COMMON), False),
        Task("frequent_words", frequent_words, lambda d: 26.0 ** -(3 * TOP), False),
        Task("copy", copy, lambda d: 26.0**-SPAN),
    ]
}
