"""Instances of the suite: every one a pure function of (task, length, depth, seed, sample,
tokenizer, haystack), checked before anything is scored."""

from __future__ import annotations

import random
from collections.abc import Sequence

from longctx.eval.ruler.instances import (
    Instance,
    Layout,
    NoiseHaystack,
    RulerInputError,
    assemble,
    encode,
    resolve_haystack,
)
from longctx.eval.ruler.tasks import DIGITS, TASKS, Task, _TooShort

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# every task, in the order of the tables
TASK_NAMES = tuple(TASKS)


def check_tasks(names: Sequence[str] | str | None, known: Sequence[str] = TASK_NAMES) -> list[str]:
    """Task names (a list or "a,b"), each one of ``known``; None -> all of them."""
    if names is None:
        return list(known)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise RulerInputError(
            f"unknown task ({', '.join(map(repr, unknown)) or 'none given'}); expected some of "
            f"{', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def check_depth(depth) -> float:
    ok = isinstance(depth, int | float) and not isinstance(depth, bool) and 0.0 <= depth <= 1.0
    if not ok:
        raise RulerInputError(f"depth={depth}; expected a fraction in [0, 1] (0 = the start)")
    return float(depth)


def task(name: str) -> Task:
    return TASKS[check_tasks([name])[0]]


def rng_for(name: str, seed: int, length: int, depth: float, sample: int) -> random.Random:
    """The instance's own random stream (the passkey keeps the probe's historical namespace)."""
    prefix = "passkey" if name == "passkey" else f"ruler/{name}"
    return random.Random(f"{prefix}/{seed}/{length}/{depth}/{sample}")


def make_instance(
    name: str,
    tokenizer,
    length: int,
    depth: float,
    seed: int,
    sample: int = 0,
    haystack="noise",
    digits: int = DIGITS,
) -> Instance:
    """One instance of ``length`` input tokens, its (first) needle at ``depth`` in [0, 1]."""
    spec, depth = task(name), check_depth(depth)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise RulerInputError(f"length={length!r}; expected an int >= 1 (input tokens)")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise RulerInputError(f"digits={digits!r}; expected an int >= 1")
    rng = rng_for(name, seed, length, depth, sample)
    tokens, layout, reference = build_tokens(spec, tokenizer, length, depth, rng, haystack, digits)
    distance = None if reference is None else len(tokens) - len(layout.answer) - reference[0]
    return Instance(
        name, length, depth, sample, seed, tokens, layout.answer_text, len(layout.answer),
        reference, distance, len(layout.question),
    )  # fmt: skip


def build_tokens(spec: Task, tokenizer, length: int, depth: float, rng, haystack, digits: int):
    """(tokens [length + 1], the layout, the reference span) of one instance drawn from ``rng``."""
    enc = lambda text: encode(tokenizer, text)  # noqa: E731
    try:
        layout = spec.build(rng, enc, length + 1, depth, digits)
    except _TooShort as err:
        raise RulerInputError(
            f"{spec.name} length={length} is too short ({err}); evaluate at a longer length"
        ) from None
    return fill(layout, spec.name, tokenizer, length, rng, haystack if spec.uses_haystack else None)


def fill(layout: Layout, name: str, tokenizer, length: int, rng, haystack):
    """The layout with the haystack (noise when None) filling the rest of ``length + 1``."""
    n_filler = length + 1 - layout.fixed_tokens
    if n_filler < 0:
        raise RulerInputError(
            f"{name} length={length} is too short: its needles, question and answer alone take "
            f"{layout.fixed_tokens - 1} input tokens (the task's minimum); evaluate at a longer "
            "length"
        )
    source = NoiseHaystack() if haystack is None else resolve_haystack(haystack)
    tokens, reference = assemble(layout, source.tokens(tokenizer, rng, n_filler))
    return tokens, layout, reference


def make_instances(
    tokenizer,
    tasks: Sequence[str] | str | None,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 4,
    seed: int = 0,
    haystack="books",
    cache_dir: str | None = None,
    digits: int = DIGITS,
) -> list[Instance]:
    """Every (task, length, depth, sample) instance in that order; one haystack for all."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise RulerInputError(f"samples={samples!r}; expected an int >= 1")
    names = check_tasks(tasks)
    depths = [check_depth(d) for d in depths]
    if not lengths or not depths:
        raise RulerInputError(f"lengths={list(lengths)}, depths={depths}; expected some of each")
    source = (
        resolve_haystack(haystack, cache_dir)
        if any(TASKS[n].uses_haystack for n in names)
        else None
    )
    return [
        make_instance(n, tokenizer, length, d, seed, s, source, digits)
        for n in names
        for length in lengths
        for d in depths
        for s in range(samples)
    ]


def chance(name: str, digits: int = DIGITS) -> float:
    """The accuracy of a guess that knows the answer's format but not the context."""
    return task(name).chance(digits)
