"""Every synthetic task by name: the one registry the suite, the synthesizer, the held-out answer
loss and the recall study ask.

A task belongs to one family (``ruler``, ``lc``, ``dense``, ``ood``, ``mqar``), which says how
its documents are made and who reads them: RULER's are scored, never trained on; ``lc_*`` both.
``USES`` says which tasks each reader takes, and what naming none stands for:
``check_tasks(names, use)`` is the one check of a list of task names.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

import numpy as np

from longctx.synthetic import dense, lc_formats, mqar, ood, ruler
from longctx.synthetic.layout import Assembled, Draw, Layout, assemble
from longctx.synthetic.pieces import DoesNotFit, Encoder, TaskInputError

STRING_MATCH_ALL, STRING_MATCH_PART = "string_match_all", "string_match_part"
FAMILIES = ("ruler", "lc", "dense", "ood", "mqar")


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's generator and how it is read and scored.

    ``build``, by ``family``: ``Draw -> Layout`` (ruler, lc: an instance), ``(rng, enc, length)
    -> Layout`` (dense: inserts only), ``(rng, length) -> events`` (ood), ``(MqarSpec, numpy
    Generator) -> MqarDocument`` (mqar). The suite's fields (ruler, lc): ``tokens_to_generate``;
    ``metric``; ``reads``, what the instance must supply: "haystack" (the essay / lc haystack),
    "qa" (a --qa-data folder) or "" (nothing: its own noise, needles or lists); ``chance``:
    digits -> the accuracy of a context-free guess (teacher-forced); ``qa_dataset``.
    """

    name: str
    family: str
    build: Callable
    tokens_to_generate: int = 0
    metric: str = STRING_MATCH_ALL
    reads: str = ""
    chance: Callable[[int], float] = lambda digits: 0.0
    qa_dataset: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"task {self.name}: family {self.family!r}; expected one of {FAMILIES}"
            )


def _ruler_tasks() -> list[Task]:
    niah = [
        Task(n, "ruler", spec, ruler.TOKENS_TO_GENERATE["niah"],
             reads="haystack" if spec.haystack == "essay" else "",
             chance=lambda d, v=spec.value, k=spec.values * spec.queries: 9e6 ** -k if v == "numbers" else 0.0)
        for n, spec in ruler.NIAH.items()
    ]  # fmt: skip
    return niah + [
        Task("vt", "ruler", ruler.variable_tracking, ruler.TOKENS_TO_GENERATE["vt"]),
        Task("cwe", "ruler", ruler.common_words_extraction, ruler.TOKENS_TO_GENERATE["cwe"]),
        Task("fwe", "ruler", ruler.freq_words_extraction, ruler.TOKENS_TO_GENERATE["fwe"]),
        Task("qa_1", "ruler", ruler.qa("squad"), ruler.TOKENS_TO_GENERATE["qa"],
             STRING_MATCH_PART, reads="qa", qa_dataset="squad"),
        Task("qa_2", "ruler", ruler.qa("hotpotqa"), ruler.TOKENS_TO_GENERATE["qa"],
             STRING_MATCH_PART, reads="qa", qa_dataset="hotpotqa"),
    ]  # fmt: skip


def _lc_tasks() -> list[Task]:
    lc, n = lc_formats, lc_formats.NEEDLES
    spec = [
        ("lc_passkey", lc.passkey, 16, lambda d: 10.0**-d),
        ("lc_niah_single", lc.niah_single, 16, lambda d: 10.0**-d),
        ("lc_niah_multikey", lc.niah_multikey, 16, lambda d: 10.0**-d),
        ("lc_niah_multivalue", lc.niah_multivalue, 48, lambda d: 10.0 ** -(n * d)),
        ("lc_niah_multiquery", lc.niah_multiquery, 48, lambda d: 10.0 ** -(n * d)),
        ("lc_variable_tracking", lc.variable_tracking, 48, lambda d: 26.0 ** -(5 * n)),
        ("lc_common_words", lc.common_words, 64,
         lambda d: 1 / math.perm(len(lc.WORDS), lc.COMMON)),
        ("lc_frequent_words", lc.frequent_words, 24, lambda d: 26.0 ** -(3 * lc.TOP)),
        ("lc_copy", lc.copy, 24, lambda d: 26.0**-lc.SPAN),
    ]  # fmt: skip
    return [Task(name, "lc", build, ttg, reads="haystack", chance=chance)
            for name, build, ttg, chance in spec]  # fmt: skip


def _training_tasks() -> list[Task]:
    builds = [("kv_recall", "dense", dense.kv_recall), ("copy", "dense", dense.copy),
              ("repeat", "dense", dense.repeat), ("ood_ledger", "ood", ood.ledger),
              ("ood_locker", "ood", ood.locker), ("ood_relay", "ood", ood.relay),
              ("ood_echo", "ood", ood.echo), (mqar.KIND, "mqar", mqar.MqarSpec.document)]  # fmt: skip
    return [Task(name, family, build) for name, family, build in builds]


TASKS: dict[str, Task] = {t.name: t for t in _ruler_tasks() + _lc_tasks() + _training_tasks()}


def names_of(*families: str) -> tuple[str, ...]:
    """The tasks of ``families``, family by family in the order given (registry order within)."""
    return tuple(t.name for f in families for t in TASKS.values() if t.family == f)


RULER_TASKS: tuple[str, ...] = names_of("ruler")
SUITE_TASKS: tuple[str, ...] = names_of("ruler", "lc")  # the suite's tables: RULER's, then lc_*


@dataclasses.dataclass(frozen=True)
class Use:
    """The tasks a reader takes, and what naming none stands for (None: a name is required)."""

    known: tuple[str, ...]
    default: tuple[str, ...] | None = None


USES = {
    "suite": Use(SUITE_TASKS, default=RULER_TASKS),  # longctx.eval.ruler
    "synthesize": Use(names_of("dense", "ood", "lc")),  # longctx.data.synthesize
    "answer_loss": Use(names_of("ood"), default=names_of("ood")),  # longctx.eval.answer_loss
}


def check_tasks(names: Sequence[str] | str | None, use: str) -> list[str]:
    """Task names for ``use`` (a list or "a,b"), each one it takes, without repeats; None ->
    its default (refused where it has none)."""
    allowed = USES[use]
    if names is None and allowed.default is not None:
        return list(allowed.default)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = names or []
    unknown = [n for n in names if n not in allowed.known]
    if unknown or not names:
        raise TaskInputError(
            f"unknown task ({', '.join(map(repr, unknown)) or 'none given'}); expected some of "
            f"{', '.join(allowed.known)}"
        )
    return list(dict.fromkeys(names))


def lay_out(
    task: Task, enc: Encoder, length: int, depth: float, rng: random.Random,
    haystack=None, qa: dict | None = None, digits: int = lc_formats.DIGITS,
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


def training_tokens(
    task: Task, rng: random.Random, enc: Encoder, length: int, longest: int, haystack
) -> np.ndarray:
    """A training document of ``task`` (EOS not included) of about ``length`` tokens, with
    ``haystack``'s units around its needles; DoesNotFit when it needs ``longest`` tokens or more
    (a dense task: more than ``longest``)."""
    if task.family == "ood":  # the suite's formats nowhere (longctx.synthetic.ood)
        tokens, _ = ood.document(task.build, rng, enc, length - 1, haystack.units(enc, rng, " "))
        if len(tokens) >= longest:
            raise DoesNotFit(f"{task.name} needs {len(tokens)} tokens")
        return tokens
    if task.family == "dense":
        layout = task.build(rng, enc, length)
        if layout.fixed_tokens > longest:
            raise DoesNotFit(f"{task.name} needs {layout.fixed_tokens} tokens")
        length = max(length, layout.fixed_tokens)  # a short draw still holds one needle
        filler = haystack.tokens(enc, rng, length)  # needles at any token, not per sentence
        return assemble(layout, length, (filler[i : i + 1] for i in range(length))).prompt
    if task.family == "lc":
        return _instance_tokens(task, enc, length, longest, rng, haystack)
    raise ValueError(f"{task.name} ({task.family}) makes no training document of text")


def _instance_tokens(
    task: Task, enc: Encoder, length: int, longest: int, rng, haystack
) -> np.ndarray:
    """A suite instance at ``length`` or, when that is too short for it, the next doubling."""
    depth = rng.random()
    while True:
        try:
            layout, laid = lay_out(task, enc, length, depth, rng, haystack)
            return np.concatenate([laid.prompt, layout.answer])
        except DoesNotFit:
            if length >= longest:
                raise
            length = min(2 * length, longest)
