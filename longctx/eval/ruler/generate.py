"""Instances of the suite: every one a pure function of (task, length, depth, seed, sample,
tokenizer, haystack, qa data), checked before anything is scored.

``make_instances`` is strict (a length too short for a task is refused); ``plan_instances``
skips such (task, length) cells and says why, which is what the suite's default runs do.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.data.corpus import resolve_haystack
from longctx.errors import is_number
from longctx.eval.ruler.instances import Instance, RulerInputError
from longctx.synthetic import DoesNotFit, Encoder, RunsOut
from longctx.synthetic.lc_formats import DIGITS
from longctx.synthetic.qa import QAData, load_qa_folder
from longctx.synthetic.tasks import TASKS, Task, check_tasks, lay_out

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NO_QA_DATA = "no --qa-data folder (RULER's SQuAD / HotpotQA JSON; nothing is downloaded)"


def check_depth(depth) -> float:
    ok = is_number(depth) and 0.0 <= depth <= 1.0
    if not ok:
        raise RulerInputError(f"depth={depth}; expected a fraction in [0, 1] (0 = the start)")
    return float(depth)


def task(name: str) -> Task:
    return TASKS[check_tasks([name], "suite")[0]]


def rng_for(name: str, seed: int, length: int, depth: float, sample: int) -> random.Random:
    """The instance's own random stream (lc_passkey keeps the probe's historical namespace)."""
    prefix = "passkey" if name == "lc_passkey" else f"ruler/{name}"
    return random.Random(f"{prefix}/{seed}/{length}/{depth}/{sample}")


_ENCODERS: dict[int, tuple[object, Encoder]] = {}


def encoder(tokenizer) -> Encoder:
    """One memoised encoder per tokenizer object (haystack sentences recur across instances)."""
    held = _ENCODERS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        if len(_ENCODERS) >= 4:
            _ENCODERS.clear()
        held = _ENCODERS[id(tokenizer)] = (tokenizer, Encoder(tokenizer))
    return held[1]


def resolve_qa(qa_data) -> dict[str, QAData] | None:
    """None, a folder (``--qa-data``) or already-read datasets."""
    if qa_data is None or isinstance(qa_data, dict):
        return qa_data
    return load_qa_folder(Path(qa_data))


def make_instance(
    name: str,
    tokenizer,
    length: int,
    depth: float,
    seed: int,
    sample: int = 0,
    haystack="books",
    digits: int = DIGITS,
    qa_data=None,
    cache_dir: str | None = None,
) -> Instance:
    """One instance of ``length`` tokens (prompt + tokens_to_generate), its (first) needle at
    ``depth`` in [0, 1]; a length too short for the task is refused (one line)."""
    spec, depth = task(name), check_depth(depth)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise RulerInputError(f"length={length!r}; expected an int >= 1 (tokens)")
    if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
        raise RulerInputError(f"digits={digits!r}; expected an int >= 1")
    qa = resolve_qa(qa_data)
    if spec.reads == "qa" and spec.qa_dataset not in (qa or {}):
        raise RulerInputError(f"{name} needs RULER's {spec.qa_dataset}.json: {NO_QA_DATA}")
    source = resolve_haystack(haystack, cache_dir) if spec.reads == "haystack" else None
    rng = rng_for(name, seed, length, depth, sample)
    try:
        layout, laid = lay_out(spec, encoder(tokenizer), length, depth, rng, source, qa, digits)
    except RunsOut as err:
        raise RulerInputError(
            f"{name} length={length} is too long for its material ({err}); evaluate at a "
            "shorter length or give it more (a larger --qa-data folder)"
        ) from None
    except DoesNotFit as err:
        raise RulerInputError(
            f"{name} length={length} is too short ({err}); evaluate at a longer length"
        ) from None
    prompt = laid.prompt
    distance = None if laid.reference is None else len(prompt) - laid.reference[0]
    return Instance(
        name, length, depth, sample, seed, np.concatenate([prompt, layout.answer]), layout.answer_text,
        len(layout.answer), laid.reference, distance, len(layout.question), layout.references,
        spec.metric, spec.tokens_to_generate,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Plan:
    """The instances to score, and the (task, length) cells skipped with the reason."""

    instances: list[Instance]
    skipped: list[dict]  # {"task", "length", "reason"}

    def describe(self) -> str:
        ran = list(dict.fromkeys(i.task for i in self.instances))
        lines = [f"ran: {', '.join(ran) or 'nothing'}"]
        for s in self.skipped:
            length = "every length" if s["length"] is None else f"length {s['length']}"
            lines.append(f"skipped {s['task']} at {length}: {s['reason']}")
        return "\n".join(lines)


def plan_instances(
    tokenizer,
    tasks: Sequence[str] | str | None,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 4,
    seed: int = 0,
    haystack="books",
    cache_dir: str | None = None,
    digits: int = DIGITS,
    qa_data=None,
    strict: bool = False,
) -> Plan:
    """Every (task, length, depth, sample) instance in that order, one haystack for all; a
    (task, length) cell the length cannot hold, and a qa task without its data, are skipped and
    said (``strict``: refused, one line). Refused: an unknown task, bad depths or samples, and
    a plan where nothing is left."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise RulerInputError(f"samples={samples!r}; expected an int >= 1")
    names = check_tasks(tasks, "suite")
    depths = [check_depth(d) for d in depths]
    if not lengths or not depths:
        raise RulerInputError(f"lengths={list(lengths)}, depths={depths}; expected some of each")
    qa = resolve_qa(qa_data)
    reads_haystack = any(TASKS[n].reads == "haystack" for n in names)
    source = resolve_haystack(haystack, cache_dir) if reads_haystack else None
    instances: list[Instance] = []
    skipped: list[dict] = []
    for name in names:
        if not strict and TASKS[name].reads == "qa" and TASKS[name].qa_dataset not in (qa or {}):
            skipped.append({"task": name, "length": None, "reason": NO_QA_DATA})
            continue
        for length in lengths:
            try:
                instances += [
                    make_instance(name, tokenizer, length, d, seed, s, source, digits, qa)
                    for d in depths
                    for s in range(samples)
                ]
            except RulerInputError as err:
                if strict:
                    raise
                skipped.append({"task": name, "length": length, "reason": str(err)})
    if not instances:
        raise RulerInputError(
            f"no instance fits: lengths {list(lengths)} are below every task's minimum or the "
            f"tasks were skipped ({'; '.join(s['reason'] for s in skipped[:2])}); evaluate at "
            "longer lengths"
        )
    return Plan(instances, skipped)


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
    qa_data=None,
) -> list[Instance]:
    """:func:`plan_instances`' instances, strict: a length too short for a task, or a qa task
    without its data, is refused (one line)."""
    args = (tokenizer, tasks, lengths, depths, samples, seed, haystack, cache_dir, digits, qa_data)
    return plan_instances(*args, strict=True).instances


def chance(name: str, digits: int = DIGITS) -> float:
    """The accuracy of a teacher-forced guess that knows the answer's format, not the context."""
    return task(name).chance(digits)
