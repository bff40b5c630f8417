"""Effective length, on a 0-1 scale throughout (RULER reports x 100):

- :func:`ruler_effective_length` is RULER's: the longest evaluated length whose suite score (the
  mean over RULER's tasks of each task's mean score) exceeds 0.856 (Llama-2-7B's RULER score at
  4K). It is the number comparable with RULER's table, when the suite ran RULER's tasks.
- :func:`relative_effective_length` is this repository's own, relative rule, named as such:
  the threshold is ``max(0.85 x the score at the anchor length (the training length), chance +
  0.2)`` and the effective length the longest length up to which every evaluated length from the
  shortest stays at or above it (monotone: a length after a failing one never counts). It says
  something for a small model that never reaches RULER's absolute bar; it is reported next to
  RULER's, never instead.

Each gets a bootstrap interval: instances are resampled within every task x length cell, the
suite scores and the effective length recomputed per replicate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from longctx.eval.ruler.generate import chance
from longctx.eval.ruler.instances import RulerInputError
from longctx.eval.ruler.tables import suite_table
from longctx.synthetic.tasks import RULER_TASKS

FRACTION = 0.85
MARGIN = 0.2
RULER_THRESHOLD = 0.856  # Llama-2-7B's RULER score at 4K (85.6 on RULER's 0-100 scale)
N_BOOT = 1000


def _check_scores(scores: dict[int, float]) -> None:
    if not scores:
        raise RulerInputError("effective length needs scores at one length at least")
    bad = {n: s for n, s in scores.items() if not (isinstance(s, int | float) and 0 <= s <= 1)}
    if bad:
        raise RulerInputError(
            f"suite scores outside [0, 1] ({bad}); expected fractions (RULER's percentages / 100)"
        )


def ruler_effective_length(scores: dict[int, float]) -> int | None:
    """RULER's effective length: the longest evaluated length whose suite score (0-1, the mean
    over RULER's tasks) exceeds 0.856; None when no length does (RULER's "< 4K").

    The README's words are "the longest length exceeding"; read as "the longest length before
    the first one that does not", every row of its table gives the same answer (their scores
    fall with length wherever they cross the bar). The literal reading is kept: a length after
    a failing one counts when it exceeds the bar.
    """
    _check_scores(scores)
    passing = [n for n, s in scores.items() if s > RULER_THRESHOLD]
    return max(passing) if passing else None


@dataclasses.dataclass(frozen=True)
class RelativeEffectiveLength:
    """The relative rule's result (see the module docstring): ``length`` None when the score
    is below the threshold already at the shortest evaluated length."""

    length: int | None
    threshold: float
    anchor: int  # the length the threshold is relative to (the training length)
    anchor_score: float
    chance: float
    fraction: float = FRACTION
    margin: float = MARGIN

    @property
    def rule(self) -> str:
        return (
            f"relative: the longest evaluated length up to which the suite score stays >= "
            f"max({self.fraction} x {self.anchor_score:.3f} (the score at the training length "
            f"{self.anchor}), chance {self.chance:.3f} + {self.margin}) = {self.threshold:.3f}"
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rule": self.rule}


def relative_effective_length(
    scores: dict[int, float],
    anchor: int,
    chance_level: float,
    fraction: float = FRACTION,
    margin: float = MARGIN,
) -> RelativeEffectiveLength:
    """The relative rule on ``{length: suite score}``, anchored at the evaluated length ``anchor``."""
    _check_scores(scores)
    if anchor not in scores:
        raise RulerInputError(
            f"the relative effective length is anchored at the training length ({anchor}), "
            f"which was not evaluated (lengths {sorted(scores)}); evaluate it too"
        )
    threshold = max(fraction * scores[anchor], chance_level + margin)
    best = None
    for length in sorted(scores):
        if scores[length] < threshold:
            break
        best = length
    return RelativeEffectiveLength(
        best, threshold, anchor, scores[anchor], chance_level, fraction, margin
    )


def suite_scores(results: Sequence[dict], tasks: Sequence[str]) -> dict[int, float]:
    """{length: the mean over ``tasks`` of each task's mean score}."""
    rows = [r for r in results if r["task"] in set(tasks)]
    return {r["length"]: r["score"] for r in suite_table(rows)}


def bootstrap_effective_length(
    results: Sequence[dict],
    tasks: Sequence[str],
    rule: Callable[[dict[int, float]], int | None],
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> tuple[int | None, int | None]:
    """95% interval of ``rule``'s effective length over ``tasks``: every replicate resamples
    the instances of each task x length cell with replacement (None: below every length)."""
    cells: dict[tuple[int, str], list[float]] = {}
    for r in results:
        if r["task"] in set(tasks):
            cells.setdefault((r["length"], r["task"]), []).append(float(r["score"]))
    rng = np.random.default_rng(seed)
    means = {
        key: np.asarray(v)[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(1)
        for key, v in sorted(cells.items())
    }
    lengths = sorted({n for n, _ in cells})
    suite = {n: np.mean([m for (k, _), m in means.items() if k == n], axis=0) for n in lengths}
    found = [rule({n: float(suite[n][b]) for n in lengths}) or 0 for b in range(n_boot)]
    low = int(np.quantile(found, 0.025, method="lower"))
    high = int(np.quantile(found, 0.975, method="higher"))
    return low or None, high or None


def effective_lengths(results: Sequence[dict], anchor: int | None = None) -> dict:
    """RULER's effective length over the RULER tasks scored (with the tasks named, and said
    when some are missing) and, given the training length ``anchor``, the relative one over
    every task scored, each with its bootstrap interval."""
    ruler_tasks = [t for t in RULER_TASKS if any(r["task"] == t for r in results)]
    out: dict = {"ruler": None, "relative": None}
    if ruler_tasks:
        scores = suite_scores(results, ruler_tasks)
        missing = [t for t in RULER_TASKS if t not in ruler_tasks]
        out["ruler"] = {
            "length": ruler_effective_length(scores),
            "ci": list(bootstrap_effective_length(results, ruler_tasks, ruler_effective_length)),
            "threshold": RULER_THRESHOLD,
            "tasks": ruler_tasks,
            "missing_tasks": missing,
            # lengths whose mean is over fewer of them (a task skipped there: too short)
            "missing_at": _missing_at(results, ruler_tasks),
            "rule": "RULER: the longest evaluated length whose mean score over RULER's tasks "
            f"exceeds {RULER_THRESHOLD}" + (f" (without {', '.join(missing)})" if missing else ""),
        }
    if anchor is not None:
        names = sorted({r["task"] for r in results})
        floor = float(np.mean([chance(n) for n in names]))
        found = relative_effective_length(suite_scores(results, names), anchor, floor)

        def rule(scores: dict[int, float]) -> int | None:
            return relative_effective_length(scores, anchor, floor).length

        out["relative"] = {
            **found.to_dict(),
            "ci": list(bootstrap_effective_length(results, names, rule)),
            "tasks": names,
        }
    return out


def _missing_at(results: Sequence[dict], tasks: Sequence[str]) -> dict[int, list[str]]:
    scored: dict[int, set[str]] = {}
    for r in results:
        scored.setdefault(r["length"], set()).add(r["task"])
    gaps = {n: [t for t in tasks if t not in scored[n]] for n in sorted(scored)}
    return {n: gap for n, gap in gaps.items() if gap}
