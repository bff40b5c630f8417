"""Long-range training tasks disjoint from the evaluated suite: other templates, keys and values.

A model trained on the suite's own formats ("One of the special magic numbers for K is: V.",
adjective-noun keys, 5- and 7-digit numbers, uuids, "Copy this:") can pass the suite by copying
the template's continuation; trained on these it has to retrieve in a format it never saw
evaluated. Nothing here is shared with the suite (tests/unit/test_ood_mix.py checks it on
generated text).

The value tokens of every query (the part only retrieval predicts) are the document's *answer
tokens*: :func:`document` returns their mask, which the held-out answer loss
(:mod:`longctx.eval.answer_loss`) scores. Events are placed between the sentences of a haystack
(the synthesizer's: the embedded corpus's training chapters).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Iterable

import numpy as np

from longctx.synthetic.layout import Layout, assemble
from longctx.synthetic.pieces import Encoder, cat

# consonant-vowel syllables: codes like "Kavoretiq" (4 syllables: 12^4 x 5^4 = 13 M of them)
_CONSONANTS, _VOWELS = "bdfgklmnprtv", "aeiou"
HEX = "0123456789abcdef"
# the dense tasks: an event (entry and its lookup, ...) per this many tokens of the document
EVERY = {"ood_ledger": 256, "ood_locker": 256, "ood_relay": 384, "ood_echo": 128}
HOPS = 3  # ood_relay: links before the stored value
ECHO_WORDS = 4  # ood_echo: syllable words in a span

# the literal text of each template (tests check none is in the suite's texts)
TEMPLATES = {
    "ood_ledger": (" Entry {key} -> #", " Lookup {key} -> #"),
    "ood_locker": (" {key}'s locker holds", " Open {key}'s locker:"),
    "ood_relay": (" Node {key} links to {next}.", " Node {key} stores", " Trail from {key}:"),
    "ood_echo": (" Memorize:", " Recite:"),
}
# a value format per task (regular expressions; the test checks the suite has none of them)
VALUE_FORMATS = {
    "ood_ledger": r"#[0-9a-f]{6}",
    # six digits on their own (the suite: 5 and 7 digits, uuids, list numbers up to 5 digits)
    "ood_locker": r"(?<![0-9A-Za-z-])[0-9]{6}(?![0-9A-Za-z-])",
    "ood_relay": r"[A-Z]{3}/[A-Z]{3}",
    "ood_echo": r"(?:[bdfgklmnprtv][aeiou]){2}q(?: (?:[bdfgklmnprtv][aeiou]){2}q){3}",
}

Part = tuple[str, bool]  # (text, is it answer tokens)
Event = tuple[float, list[Part]]  # (where in the filler, 0..1; its parts)


def syllables(rng: random.Random, count: int) -> str:
    """Consonant-vowel syllables and a final 'q', which no English word of the suite's lists
    ends in: a code is never one of its keys or words."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(count)) + "q"


def codes(rng: random.Random, count: int, size: int = 4) -> list[str]:
    """``count`` distinct capitalised syllable codes ("Kavoretiq")."""
    found: list[str] = []
    while len(found) < count:
        code = syllables(rng, size).capitalize()
        if code not in found:
            found.append(code)
    return found


def hex_value(rng: random.Random) -> str:
    """Six hex digits, two of them letters at least: never a run of five digits (the suite's
    values are 5- and 7-digit numbers)."""
    while True:
        value = "".join(rng.choice(HEX) for _ in range(6))
        if sum(c.isalpha() for c in value) >= 2:
            return value


def letter_code(rng: random.Random) -> str:
    pick = lambda: "".join(rng.choice(string.ascii_uppercase) for _ in range(3))  # noqa: E731
    return f"{pick()}/{pick()}"


def _later(rng: random.Random, at: float) -> float:
    return rng.uniform(at, 1.0)


def ledger(rng: random.Random, length: int) -> list[Event]:
    events = []
    for key in codes(rng, _count("ood_ledger", length)):
        value, at = hex_value(rng), rng.random()
        events.append((at, [(f" Entry {key} -> #", False), *_value(value, False)]))
        events.append((_later(rng, at), [(f" Lookup {key} -> #", False), *_value(value)]))
    return events


def locker(rng: random.Random, length: int) -> list[Event]:
    events = []
    for name in codes(rng, _count("ood_locker", length)):
        value, at = "".join(rng.choice(string.digits) for _ in range(6)), rng.random()
        events.append((at, [(f" {name}'s locker holds", False), *_value(f" {value}", False)]))
        events.append((_later(rng, at), [(f" Open {name}'s locker:", False), *_value(f" {value}")]))
    return events


def relay(rng: random.Random, length: int) -> list[Event]:
    events = []
    for _ in range(_count("ood_relay", length)):
        nodes, value = codes(rng, HOPS + 1, size=2), letter_code(rng)
        depths = sorted(rng.random() for _ in range(HOPS + 1))
        links = list(zip(nodes, nodes[1:], strict=False))
        rng.shuffle(links)  # the hops are not in reading order: following them needs lookups
        for at, (node, nxt) in zip(depths[:HOPS], links, strict=True):
            events.append((at, [(f" Node {node} links to {nxt}.", False)]))
        stored = [(f" Node {nodes[-1]} stores", False), *_value(f" {value}", False)]
        events.append((depths[HOPS], stored))
        ask = [(f" Trail from {nodes[0]}:", False), *_value(f" {value}")]
        events.append((_later(rng, depths[HOPS]), ask))
    return events


def echo(rng: random.Random, length: int) -> list[Event]:
    events = []
    for _ in range(_count("ood_echo", length)):
        span = " ".join(syllables(rng, 2) for _ in range(ECHO_WORDS))
        at = rng.random()
        events.append((at, [(" Memorize:", False), *_value(f" {span}", False)]))
        events.append((_later(rng, at), [(" Recite:", False), *_value(f" {span}")]))
    return events


def _value(text: str, answer: bool = True) -> list[Part]:
    """A value and its full stop, encoded apart: in a query the value is the answer."""
    return [(text, answer), (".", False)]


def _count(name: str, length: int) -> int:
    return max(1, length // EVERY[name])


Events = Callable[[random.Random, int], list[Event]]  # a task: ledger, locker, relay, echo


def layout(
    events: Events, rng: random.Random, enc: Encoder, length: int
) -> tuple[Layout, np.ndarray]:
    """The task's events as a :class:`Layout` (one insert per event, every part encoded alone,
    so a value's tokens in a query equal its tokens where it was stated), and per insert token
    whether it is an answer token (the inserts' tokens concatenated)."""
    inserts, answer = [], []
    for at, event in events(rng, length):
        pieces = [(enc(text), is_answer) for text, is_answer in event]
        inserts.append((at, cat(*(p for p, _ in pieces))))
        answer += [np.full(len(p), is_answer) for p, is_answer in pieces]
    return Layout(inserts=inserts), np.concatenate(answer)


def document(
    events: Events, rng: random.Random, enc: Encoder, length: int, units: Iterable[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, answer mask) of ``length`` tokens: the task's events between haystack units
    (sentences), or as many tokens as the events take when ``length`` is too short for them.
    ``events``: the task's generator (its ``build`` in longctx.synthetic.tasks.TASKS)."""
    laid_out, answer = layout(events, rng, enc, length)
    assembled = assemble(laid_out, max(length, laid_out.fixed_tokens), units)
    mask = np.zeros(len(assembled.prompt), bool)
    offset = 0
    for i, (_, piece) in enumerate(laid_out.inserts):
        start = assembled.insert_starts[i]
        mask[start : start + len(piece)] = answer[offset : offset + len(piece)]
        offset += len(piece)
    return assembled.prompt, mask
