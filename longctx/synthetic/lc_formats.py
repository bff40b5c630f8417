"""longctx's own formats (its suite before it followed RULER), named ``lc_*`` so they claim
nothing of RULER's. Teacher-forced by design: the answer prefix repeats the needle's wording.
Each format, with its needle and answer: docs/effective-length.md.

``depth`` places the (first) needle; pieces go between the haystack's sentences.
"""

from __future__ import annotations

import math
import random
import string

import numpy as np

from longctx.synthetic.layout import Draw, Layout
from longctx.synthetic.pieces import DoesNotFit, cat, listing

DIGITS = 5  # digits of a passkey / magic number
NEEDLES = 4  # needles of the multi-key / multi-value / multi-query tasks, hops of the chain
COMMON = 5  # lc_common_words: the words to find
TOP = 3  # lc_frequent_words: the words to find
CODED_VOCAB = 20  # lc_frequent_words: distinct coded words per instance
SPAN = 12  # lc_copy: letters of the span

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


def number(rng: random.Random, digits: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(digits))


def keys(rng: random.Random, count: int) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        key = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if key not in out:
            out.append(key)
    return out


def needle(enc, prefix: str, value: str) -> np.ndarray:
    return cat(enc(prefix), enc(f" {value}"), enc(". "))


def _single(question: np.ndarray, answer: np.ndarray, text: str, inserts) -> Layout:
    return Layout(question=question, answer=answer, answer_text=text, references=(text,),
                  inserts=inserts)  # fmt: skip


def passkey(d: Draw) -> Layout:
    key = number(d.rng, d.digits)
    return _single(
        d.enc(" What is the pass key? The pass key is"), d.enc(f" {key}"), key,
        [(d.depth, d.enc(f" The pass key is {key}. Remember it. "))],
    )  # fmt: skip


def niah_single(d: Draw) -> Layout:
    return _niah(d, distractors=0)


def niah_multikey(d: Draw) -> Layout:
    return _niah(d, distractors=NEEDLES - 1)


def _niah(d: Draw, distractors: int) -> Layout:
    rng, enc = d.rng, d.enc
    names = keys(rng, 1 + distractors)
    values = [number(rng, d.digits) for _ in names]
    depths = [d.depth] + [rng.random() for _ in range(distractors)]
    prefix = " The magic number for {} is"
    return _single(
        cat(enc(f" What is the magic number for {names[0]}?"), enc(prefix.format(names[0]))),
        enc(f" {values[0]}"), values[0],
        [(x, needle(enc, prefix.format(k), v)) for x, k, v in zip(depths, names, values, strict=True)],
    )  # fmt: skip


def niah_multivalue(d: Draw) -> Layout:
    rng, enc = d.rng, d.enc
    key = keys(rng, 1)[0]
    values = [number(rng, d.digits) for _ in range(NEEDLES)]
    depths = [d.depth] + [rng.random() for _ in range(NEEDLES - 1)]
    in_order = [v for _, v in sorted(zip(depths, values, strict=True), key=lambda dv: dv[0])]
    return Layout(
        question=enc(f" What are all the magic numbers for {key}? The magic numbers for {key} are"),
        answer=listing(enc, in_order), answer_text=", ".join(in_order),
        references=tuple(in_order),
        inserts=[(x, needle(enc, f" A magic number for {key} is", v))
                 for x, v in zip(depths, values, strict=True)],
    )  # fmt: skip


def niah_multiquery(d: Draw) -> Layout:
    rng, enc = d.rng, d.enc
    names = keys(rng, NEEDLES)
    values = [number(rng, d.digits) for _ in names]
    depths = [d.depth] + [rng.random() for _ in range(NEEDLES - 1)]
    asked = list(range(NEEDLES))
    rng.shuffle(asked)
    said = [names[i] for i in asked]
    prefix = " The magic number for {} is"
    answers = [values[i] for i in asked]
    return Layout(
        question=enc(f" What are the magic numbers for {', '.join(said[:-1])} and {said[-1]}? They are"),
        answer=listing(enc, answers), answer_text=", ".join(answers), references=tuple(answers),
        inserts=[(x, needle(enc, prefix.format(k), v))
                 for x, k, v in zip(depths, names, values, strict=True)],
    )  # fmt: skip


def variable_tracking(d: Draw) -> Layout:
    rng, enc = d.rng, d.enc
    names: list[str] = []
    while len(names) < 2 * NEEDLES:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    chain, other = names[:NEEDLES], names[NEEDLES:]
    value, other_value = number(rng, d.digits), number(rng, d.digits)
    while other_value == value:
        other_value = number(rng, d.digits)
    chain_depths = [d.depth + (1 - d.depth) * i / NEEDLES for i in range(NEEDLES)]
    other_depths = sorted(rng.random() for _ in range(NEEDLES))
    inserts = []
    for names_, first, depths in ((chain, value, chain_depths), (other, other_value, other_depths)):
        for i, (x, name) in enumerate(zip(depths, names_, strict=True)):
            source = first if i == 0 else f"VAR {names_[i - 1]}"
            inserts.append((x, cat(enc(f" VAR {name} ="), enc(f" {source}"), enc(". "))))
    return Layout(
        question=enc(f" Which variables are assigned the value {value}? They are"),
        answer=listing(enc, chain), answer_text=", ".join(chain), references=tuple(chain),
        inserts=inserts,
    )  # fmt: skip


def common_words(d: Draw) -> Layout:
    rng, enc = d.rng, d.enc
    words = list(WORDS)
    rng.shuffle(words)
    common, pool = words[:COMMON], words[COMMON:]
    question = enc(f" What are the {COMMON} most common words in the list above? They are")
    pieces = {w: cat(enc(f" {w}"), enc(",")) for w in words}
    room = d.budget - len(question) - len(enc(" Words:"))
    entries = room // max(len(p) for p in pieces.values())
    # half the entries are the common words: each appears more often than any other word
    count = max(2, entries // (2 * COMMON))
    rest = entries - COMMON * count
    repeats = math.ceil(rest / len(pool)) if rest > 0 else 0
    if rest < 0 or count <= repeats:
        raise DoesNotFit(f"{d.budget} tokens do not hold a word list with a clear answer")
    items = common * count + (pool * repeats)[:rest]
    rng.shuffle(items)
    first_seen = sorted(common, key=items.index)
    return Layout(
        question=question, answer=listing(enc, first_seen), answer_text=", ".join(first_seen),
        references=tuple(first_seen),
        inserts=[(1.0, cat(enc(" Words:"), *(pieces[w] for w in items)))],
    )  # fmt: skip


def frequent_words(d: Draw) -> Layout:
    rng, enc = d.rng, d.enc
    coded: list[str] = []
    while len(coded) < CODED_VOCAB:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
        if word not in coded:
            coded.append(word)
    question = enc(f" What are the {TOP} most frequent coded words in the text above? They are")
    pieces = {w: enc(f" {w}") for w in coded}
    room = d.budget - len(question) - len(enc(" Coded text:"))
    entries = room // max(len(p) for p in pieces.values())
    harmonic = sum(1 / r for r in range(1, CODED_VOCAB + 1))
    counts = [max(1, int(entries / (r * harmonic))) for r in range(1, CODED_VOCAB + 1)]
    if sum(counts) > entries or not counts[0] > counts[1] > counts[2] > counts[3]:
        raise DoesNotFit(f"{d.budget} tokens do not hold a word list with a clear answer")
    items = [w for w, c in zip(coded, counts, strict=True) for _ in range(c)]
    rng.shuffle(items)
    top = coded[:TOP]
    return Layout(
        question=question, answer=listing(enc, top), answer_text=", ".join(top),
        references=tuple(top),
        inserts=[(1.0, cat(enc(" Coded text:"), *(pieces[w] for w in items)))],
    )  # fmt: skip


def copy(d: Draw) -> Layout:
    span = "".join(d.rng.choice(string.ascii_lowercase) for _ in range(SPAN))
    cue, body = d.enc(" Copy this:"), d.enc(f" {span}")
    return Layout(
        question=cue, answer=body, answer_text=span, references=(span,),
        inserts=[(d.depth, cat(cue, body, d.enc(". ")))], reference=(0, len(cue), len(cue) + len(body)),
    )  # fmt: skip
