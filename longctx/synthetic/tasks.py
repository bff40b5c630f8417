"""Every task by name: RULER's 13 (``RULER_TASKS``, in RULER's order) and the ``lc_*`` ones."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

from longctx.synthetic import legacy, ruler
from longctx.synthetic.layout import Assembled, Draw, Layout, assemble
from longctx.synthetic.pieces import DoesNotFit, Encoder, TaskInputError

STRING_MATCH_ALL, STRING_MATCH_PART = "string_match_all", "string_match_part"


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's generator and how it is read and scored.

    ``reads``: what the instance must supply: "haystack" (the essay / legacy haystack), "qa"
    (a --qa-data folder) or "" (nothing: its own noise, needles or lists). ``ruler``: one of
    RULER's 13. ``chance``: digits -> the accuracy of a context-free guess (teacher-forced).
    """

    name: str
    build: Callable[[Draw], Layout]
    tokens_to_generate: int
    metric: str = STRING_MATCH_ALL
    reads: str = ""
    ruler: bool = True
    chance: Callable[[int], float] = lambda digits: 0.0
    qa_dataset: str | None = None


def _ruler_tasks() -> list[Task]:
    niah = [
        Task(n, spec, ruler.TOKENS_TO_GENERATE["niah"],
             reads="haystack" if spec.haystack == "essay" else "",
             chance=lambda d, v=spec.value, k=spec.values * spec.queries: 9e6 ** -k if v == "numbers" else 0.0)
        for n, spec in ruler.NIAH.items()
    ]  # fmt: skip
    return niah + [
        Task("vt", ruler.variable_tracking, ruler.TOKENS_TO_GENERATE["vt"]),
        Task("cwe", ruler.common_words_extraction, ruler.TOKENS_TO_GENERATE["cwe"]),
        Task("fwe", ruler.freq_words_extraction, ruler.TOKENS_TO_GENERATE["fwe"]),
        Task("qa_1", ruler.qa("squad"), ruler.TOKENS_TO_GENERATE["qa"], STRING_MATCH_PART,
             reads="qa", qa_dataset="squad"),
        Task("qa_2", ruler.qa("hotpotqa"), ruler.TOKENS_TO_GENERATE["qa"], STRING_MATCH_PART,
             reads="qa", qa_dataset="hotpotqa"),
    ]  # fmt: skip


def _legacy_tasks() -> list[Task]:
    n = legacy.NEEDLES
    spec = [
        ("lc_passkey", legacy.passkey, 16, lambda d: 10.0**-d),
        ("lc_niah_single", legacy.niah_single, 16, lambda d: 10.0**-d),
        ("lc_niah_multikey", legacy.niah_multikey, 16, lambda d: 10.0**-d),
        ("lc_niah_multivalue", legacy.niah_multivalue, 48, lambda d: 10.0 ** -(n * d)),
        ("lc_niah_multiquery", legacy.niah_multiquery, 48, lambda d: 10.0 ** -(n * d)),
        ("lc_variable_tracking", legacy.variable_tracking, 48, lambda d: 26.0 ** -(5 * n)),
        ("lc_common_words", legacy.common_words, 64,
         lambda d: 1 / math.perm(len(legacy.WORDS), legacy.COMMON)),
        ("lc_frequent_words", legacy.frequent_words, 24, lambda d: 26.0 ** -(3 * legacy.TOP)),
        ("lc_copy", legacy.copy, 24, lambda d: 26.0**-legacy.SPAN),
    ]  # fmt: skip
    return [Task(name, build, ttg, reads="haystack", ruler=False, chance=chance)
            for name, build, ttg, chance in spec]  # fmt: skip


RULER_TASKS: tuple[str, ...] = tuple(t.name for t in _ruler_tasks())
TASKS: dict[str, Task] = {t.name: t for t in _ruler_tasks() + _legacy_tasks()}


def check_names(names, known) -> list[str]:
    """Task names (a list or "a,b"), each one of ``known``, without repeats."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise TaskInputError(
            f"unknown task ({', '.join(map(repr, unknown)) or 'none given'}); expected some of "
            f"{', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def lay_out(
    task: Task, enc: Encoder, length: int, depth: float, rng: random.Random,
    haystack=None, qa: dict | None = None, digits: int = legacy.DIGITS,
) -> tuple[Layout, Assembled]:  # fmt: skip
    """One instance of ``task`` at ``length``: its layout and its prompt of exactly
    ``length - max(tokens_to_generate, answer tokens)`` tokens, so that both the generation
    and the teacher-forced answer fit the length; DoesNotFit when the length cannot hold it.

    An answer longer than the generation budget (cwe's ten numbered words under a byte
    tokenizer) shortens the prompt: the task is laid out again from the same random state,
    whose answer is drawn before anything that depends on the budget."""

    def build(budget: int) -> Layout:
        if budget < 1:
            raise DoesNotFit(f"it generates {length - budget} tokens")
        return task.build(Draw(rng, enc, budget, length, depth, haystack, qa, digits))

    state = rng.getstate()
    layout = build(length - task.tokens_to_generate)
    reserve = max(task.tokens_to_generate, len(layout.answer))
    if reserve > task.tokens_to_generate:
        rng.setstate(state)
        layout = build(length - reserve)
        if len(layout.answer) != reserve:  # the answer is drawn before the budget matters
            raise AssertionError(f"{task.name}: the answer changed with the budget")
    budget = length - reserve
    units = None if haystack is None else haystack.units(enc, rng, " ")
    return layout, assemble(layout, budget, units)
