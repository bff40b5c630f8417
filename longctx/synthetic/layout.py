"""A task's layout and its assembly into exactly ``n`` prompt tokens.

A prompt is ``head`` (the instruction), the context, then ``question`` (the question and the
answer prefix); the answer follows it. The context is haystack units (sentences, each with its
leading separator) with the task's inserts (needles) placed *between* units: an insert at depth
``d`` goes after ``int(k x d)`` of the ``k`` whole units (RULER's rule for its essay haystack).
The last unit is cut to make the length exact, so the context ends mid-sentence, as RULER's
word-truncated essays do; no insert follows the cut unit.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

import numpy as np

from longctx.synthetic.pieces import DoesNotFit, Encoder, RunsOut

# RULER's needle depths (percent): round(linspace(0, 100, 40))
DEPTHS = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40)).astype(int))


def grid_depth(depth: float) -> float:
    """The depth (fraction) of RULER's grid nearest to ``depth`` in [0, 1]."""
    return min(DEPTHS, key=lambda d: abs(d / 100 - depth)) / 100


def random_depth(rng: random.Random) -> float:
    """A depth drawn from RULER's grid (where RULER places the needles it does not sweep)."""
    return rng.choice(DEPTHS) / 100


def _empty() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a task generator returns.

    ``answer``: the teacher-forced answer tokens (RULER's references as an answer naturally
    writes them); ``answer_text`` that answer as text; ``references`` RULER's outputs list.
    ``inserts``: (depth in [0, 1], tokens), in order for equal depths. ``units``: the haystack's
    units (None: the instance's haystack). ``reference``: (insert index, start, stop) of a span
    the answer repeats (lc_copy scores both).
    """

    question: np.ndarray = dataclasses.field(default_factory=_empty)
    answer: np.ndarray = dataclasses.field(default_factory=_empty)
    answer_text: str = ""
    references: tuple[str, ...] = ()
    inserts: list[tuple[float, np.ndarray]] = dataclasses.field(default_factory=list)
    head: np.ndarray = dataclasses.field(default_factory=_empty)
    units: Iterable[np.ndarray] | None = None
    reference: tuple[int, int, int] | None = None

    @property
    def fixed_tokens(self) -> int:
        """Prompt tokens that are not haystack: head, inserts and question."""
        return len(self.head) + sum(len(t) for _, t in self.inserts) + len(self.question)


@dataclasses.dataclass
class Draw:
    """What a task generator gets: the instance's random stream, its encoder, the prompt's
    token budget, the depth of its (first) needle, the instance's haystack and data."""

    rng: random.Random
    enc: Encoder
    budget: int  # prompt tokens: the evaluated length less tokens_to_generate
    length: int  # the evaluated length
    depth: float = 0.5
    haystack: object | None = None  # units(enc, rng, sep) -> iterator of token arrays
    qa: dict | None = None  # dataset name ("squad", "hotpotqa") -> longctx.synthetic.qa.QAData
    digits: int = 5  # the lc_* tasks' number of digits


@dataclasses.dataclass(frozen=True)
class Assembled:
    prompt: np.ndarray
    insert_starts: dict[int, int]  # insert index -> its first token's position in the prompt
    reference: tuple[int, int] | None  # the layout's reference span, in prompt positions


def assemble(layout: Layout, n: int, units: Iterable[np.ndarray] | None = None) -> Assembled:
    """Exactly ``n`` prompt tokens: head, the context (units with the inserts), question."""
    room = n - layout.fixed_tokens
    if room < 0:
        raise DoesNotFit(f"its template and needles alone take {layout.fixed_tokens} tokens")
    whole, tail = _fill(units if layout.units is None else layout.units, room)
    parts, pos, cursor, starts = [layout.head], len(layout.head), 0, {}
    order = sorted(range(len(layout.inserts)), key=lambda i: layout.inserts[i][0])
    for i in order:
        depth, piece = layout.inserts[i]
        boundary = max(cursor, min(len(whole), int(len(whole) * depth)))
        for unit in whole[cursor:boundary]:
            parts.append(unit)
            pos += len(unit)
        cursor, starts[i] = boundary, pos
        parts.append(piece)
        pos += len(piece)
    parts += [*whole[cursor:], tail, layout.question]
    prompt = np.concatenate(parts).astype(np.int64)
    assert len(prompt) == n, (len(prompt), n)
    reference = None
    if layout.reference is not None:
        index, start, stop = layout.reference
        reference = (starts[index] + start, starts[index] + stop)
    return Assembled(prompt, starts, reference)


def _fill(units: Iterable[np.ndarray] | None, room: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Whole units while they fit in ``room`` tokens, then the next one cut to fill it exactly."""
    whole: list[np.ndarray] = []
    total = 0
    if room == 0:
        return whole, _empty()
    if units is None:
        raise DoesNotFit("it has no haystack to fill the context")
    for unit in units:
        if total + len(unit) <= room:
            whole.append(unit)
            total += len(unit)
            if total == room:
                return whole, _empty()
        else:
            return whole, np.asarray(unit[: room - total], dtype=np.int64)
    raise RunsOut(f"its material runs out before {room} context tokens")
