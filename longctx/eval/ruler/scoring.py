"""Scoring the suite, tables with 95% intervals, and effective length (RULER's and a relative one).

Two modes, every row labelled with the one it ran (``scoring``):

- ``generate`` (RULER's way): the model continues the instance's prompt greedily for the task's
  ``tokens_to_generate`` tokens (longctx's Llama from its KV cache, a transformers folder with
  transformers' ``generate``), the tokens up to the first EOS are decoded to text, and the text
  is scored with the task's RULER metric: ``string_match_all`` (the fraction of the references
  found in it, case-insensitively) or ``string_match_part`` (1 if any is). ``score`` is that
  metric; the teacher-forced match is kept beside it.
- ``teacher_forced`` (the cheap in-loop mode): one forward pass; an instance is correct when the
  model's argmax is right on every answer token, in the instance's own order and format. It is
  a stricter lower bound of RULER's metric (a model that writes the values in another order,
  case or with a preamble gets 0 here and credit from RULER; never the reverse), and ``score``
  is that 0 / 1.

Each cell (task x length x depth) reports the mean score with a 95% Wilson score interval.
The cells are small and often at 0 or 1, where the normal interval collapses to a point and a
bootstrap over so few instances returns the observed proportion again. For partial credit
(string_match_all) the interval is conservative: a score in [0, 1] with mean p has variance at
most p (1 - p), the binomial's.

Effective length, on a 0-1 scale throughout (RULER reports x 100):

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

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.distributed.context_parallel import ContextShard, gather_row
from longctx.eval.ruler.generate import RULER_TASK_NAMES, chance
from longctx.eval.ruler.instances import Instance, RulerInputError
from longctx.model.generate import generate_from_batch

Z95 = 1.959963984540054
FRACTION = 0.85
MARGIN = 0.2
RULER_THRESHOLD = 0.856  # Llama-2-7B's RULER score at 4K (85.6 on RULER's 0-100 scale)
N_BOOT = 1000
GENERATE, TEACHER_FORCED = "generate", "teacher_forced"
SCORING_MODES = (GENERATE, TEACHER_FORCED)


# ----------------------------------------------------------------------------- metrics
def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: the fraction of the references that occur in
    the prediction, case-insensitively (a substring anywhere counts, any order)."""
    found = [ref.lower() in prediction.lower() for ref in references]
    return sum(found) / len(found)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for qa: 1 if any reference occurs in the prediction (case-insensitive)."""
    return float(any(ref.lower() in prediction.lower() for ref in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def ruler_metric(name: str, prediction: str, references: Sequence[str]) -> float:
    """The per-instance score in [0, 1] of RULER's metric ``name``."""
    if name not in METRICS:
        raise RulerInputError(f"unknown metric ({name!r}); expected one of {', '.join(METRICS)}")
    if not references:
        raise RulerInputError("an instance without references cannot be scored; expected >= 1")
    return METRICS[name](prediction, references)


def check_mode(mode: str) -> str:
    if mode not in SCORING_MODES:
        raise RulerInputError(f"scoring={mode!r}; expected one of {', '.join(SCORING_MODES)}")
    return mode


# ----------------------------------------------------------------------------- scoring
def instance_batch(instances: Sequence[Instance], row_multiple: int = 1) -> PackedBatch:
    """One instance per row, teacher-forced: inputs ``tokens[:-1]`` and the answer labels; all
    instances must share a token count (see :func:`rows_batch` for ``row_multiple``)."""
    sizes = {len(p.tokens) for p in instances}
    if len(sizes) != 1:
        raise ValueError(f"a batch needs instances of one token count, got {sorted(sizes)}")
    tokens = torch.from_numpy(np.stack([p.tokens[:-1] for p in instances]))
    labels = torch.from_numpy(np.stack([p.labels() for p in instances]))
    return rows_batch(tokens, labels, row_multiple)


def prompt_batch(instances: Sequence[Instance], row_multiple: int = 1) -> PackedBatch:
    """The instances' prompts, one per row; they must share a length."""
    lengths = {len(p.prompt) for p in instances}
    if len(lengths) != 1:
        raise ValueError(f"a batch needs prompts of one length, got lengths {sorted(lengths)}")
    tokens = torch.from_numpy(np.stack([np.asarray(p.prompt, dtype=np.int64) for p in instances]))
    return rows_batch(tokens, None, row_multiple)


def rows_batch(tokens_BN: Tensor, labels_BN: Tensor | None, row_multiple: int) -> PackedBatch:
    """Each row one document at positions 0 .. N-1; with ``row_multiple`` > 1 (a context-
    parallel split needs rows of a multiple of its chunks) a pad segment goes FIRST, so the
    document is still the row's last segment (the one generation continues). Attention never
    crosses segments, so the pad changes no result."""
    b, n = tokens_BN.shape
    pad = -n % row_multiple
    if pad == 0:
        return PackedBatch.from_lengths(tokens_BN, [[n]] * b, True, labels_BN)
    tokens = torch.cat([tokens_BN.new_zeros(b, pad), tokens_BN], 1)
    labels = None
    if labels_BN is not None:
        labels = torch.cat([labels_BN.new_full((b, pad), IGNORE_INDEX), labels_BN], 1)
    return PackedBatch.from_lengths(tokens, [[pad, n]] * b, True, labels)


def answer_logits(model, batch: PackedBatch) -> Tensor:
    """Logits [num_labelled_tokens, V] at the labelled positions, in row-major order: the
    model's ``labelled_logits`` (longctx's models, the --hf scorer: no [B, L, V] tensor at long
    L), else its forward(batch) logits."""
    if hasattr(model, "labelled_logits"):
        return model.labelled_logits(batch)
    return model(batch)[batch.labels != IGNORE_INDEX]


def answer_predictions(model, batch: PackedBatch, shard=None) -> Tensor:
    """The argmax token at every labelled position of ``batch`` (row-major), run on this rank's
    ``shard(batch)`` under context parallelism and gathered from the group."""
    local = batch if shard is None else shard(batch)
    if not isinstance(local, ContextShard):
        return answer_logits(model, local).argmax(-1)
    local_mask = local.labels != IGNORE_INDEX
    predicted = torch.full_like(local.labels, -1)
    predicted[local_mask] = answer_logits(model, local).argmax(-1)
    return gather_row(predicted, local)[batch.labels != IGNORE_INDEX]


def generate_texts(
    model, instances: Sequence[Instance], tokenizer, device, shard=None, row_multiple: int = 1
) -> list[str]:
    """Each instance's greedy continuation of its prompt (its tokens_to_generate tokens, up to
    the first EOS), decoded. The instances share a prompt length and tokens_to_generate. A
    model with its own ``generate_from_batch`` (a transformers folder) generates with it."""
    max_new = max(p.tokens_to_generate for p in instances)
    batch = prompt_batch(instances, row_multiple).to(device)
    own = getattr(model, "generate_from_batch", None)
    if own is not None:
        rows = own(batch, max_new)
    else:  # every step is taken, EOS or not: ranks that share the model stay in step
        rows = generate_from_batch(model, batch if shard is None else shard(batch), max_new)
    eos = getattr(tokenizer, "eos_id", None)
    return [
        tokenizer.decode(_until(ids[: p.tokens_to_generate], eos))
        for p, ids in zip(instances, rows, strict=True)
    ]


def _until(ids: list[int], stop: int | None) -> list[int]:
    return ids[: ids.index(stop)] if stop is not None and stop in ids else ids


@torch.no_grad()
def score_instances(
    model,
    instances: Sequence[Instance],
    batch_size: int = 4,
    device: str | torch.device = "cpu",
    forward_context=None,
    *,
    scoring: str = TEACHER_FORCED,
    tokenizer=None,
    shard: Callable[[PackedBatch], PackedBatch] | None = None,
    row_multiple: int = 1,
) -> list[dict]:
    """One row per instance, in the order of ``instances`` (see :func:`result_row`).

    scoring: ``teacher_forced`` (``score`` = the teacher-forced exact match) or ``generate``
    (``score`` = RULER's metric of the greedy generation; needs ``tokenizer`` to decode it).
    forward_context: a context manager factory every forward runs under (the trainer's
    precision). shard: under context parallelism, this rank's share of a batch (the training
    step's ``LongCtxModule.rank_shard``); every rank of the group calls with the same instances,
    and ``row_multiple`` is what the split needs the rows' length to be a multiple of.
    """
    check_mode(scoring)
    if scoring == GENERATE and tokenizer is None:
        raise RulerInputError("scoring='generate' decodes what the model writes: pass tokenizer")
    context = forward_context or contextlib.nullcontext
    rows: list[dict | None] = [None] * len(instances)
    for indices in batches(instances, batch_size, key=lambda p: len(p.tokens)):
        group = [instances[i] for i in indices]
        batch = instance_batch(group, row_multiple).to(device)
        with context():
            predicted = answer_predictions(model, batch, shard).cpu()
        targets = batch.labels[batch.labels != IGNORE_INDEX].cpu()
        hits = (predicted == targets).split([p.reference_len + p.answer_len for p in group])
        for i, hit in zip(indices, hits, strict=True):
            rows[i] = result_row(instances[i], hit)
    if scoring == GENERATE:
        for indices in batches(instances, batch_size, key=_generation_key):
            group = [instances[i] for i in indices]
            with context():
                texts = generate_texts(model, group, tokenizer, device, shard, row_multiple)
            for i, text in zip(indices, texts, strict=True):
                rows[i].update(generated_fields(instances[i], text))
    return rows


def _generation_key(p: Instance) -> tuple[int, int]:
    return len(p.prompt), p.tokens_to_generate


def batches(instances: Sequence[Instance], batch_size: int, key) -> list[list[int]]:
    """Indices of the instances in batches of up to ``batch_size`` that share ``key(instance)``,
    each group in input order, groups in order of first appearance."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise RulerInputError(f"batch_size={batch_size!r}; expected an int >= 1")
    groups: dict = {}
    for i, p in enumerate(instances):
        groups.setdefault(key(p), []).append(i)
    return [g[j : j + batch_size] for g in groups.values() for j in range(0, len(g), batch_size)]


def result_row(instance: Instance, hit: Tensor) -> dict:
    """The teacher-forced row. ``hit``: the reference's hits (if any), then the answer's."""
    reference, answer = hit[: instance.reference_len], hit[instance.reference_len :]
    correct = bool(answer.all())
    return {
        "task": instance.task,
        "length": instance.length,
        "depth": instance.depth,
        "sample": instance.sample,
        "scoring": TEACHER_FORCED,
        "score": float(correct),
        "correct_teacher_forced": correct,
        "token_accuracy": float(answer.float().mean()),
        "answer": instance.answer,
        "prediction": None,
        "references": json.dumps(list(instance.references)),
        "distance": instance.distance,
        "reference_token_accuracy": float(reference.float().mean()) if len(reference) else None,
    }


def generated_fields(instance: Instance, prediction: str) -> dict:
    """What generation adds to the row: the text, and RULER's metric of it as the score."""
    score = ruler_metric(instance.metric, prediction, instance.references)
    return {"scoring": GENERATE, "prediction": prediction, "score": score}


# ------------------------------------------------------------------------------ tables
def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (nan, nan without trials); ``successes`` may be
    fractional (a sum of scores in [0, 1]), where the interval is conservative."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the bounds
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _cell(keys: dict, rows: list[dict]) -> dict:
    total = sum(float(r["score"]) for r in rows)
    low, high = wilson(total, len(rows))
    return {
        **keys,
        "n": len(rows),
        "score": total / len(rows),
        "ci_low": low,
        "ci_high": high,
        "teacher_forced": float(np.mean([bool(r["correct_teacher_forced"]) for r in rows])),
        "token_accuracy": float(np.mean([r["token_accuracy"] for r in rows])),
    }


def _grouped(results: Sequence[dict], keys: Sequence[str]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault(tuple(r[k] for k in keys), []).append(r)
    return [_cell(dict(zip(keys, key, strict=True)), rows) for key, rows in sorted(cells.items())]


def cell_table(results: Sequence[dict]) -> list[dict]:
    """Mean score with its 95% Wilson interval per (task, length, depth): the heat map's cells."""
    return _grouped(results, ("task", "length", "depth"))


def length_table(results: Sequence[dict]) -> list[dict]:
    """Per (task, length), over depths: the task's score at that length."""
    return _grouped(results, ("task", "length"))


def suite_table(results: Sequence[dict]) -> list[dict]:
    """Per length: the mean over tasks of each task's score (every task weighs the same), with
    the Wilson interval of the pooled instances (exact when tasks have equal counts)."""
    rows = []
    for length in sorted({r["length"] for r in results}):
        at = [r for r in results if r["length"] == length]
        per_task = length_table(at)
        pooled = _cell({"length": length}, at)
        rows.append(
            {
                **pooled,
                "score": float(np.mean([t["score"] for t in per_task])),
                "teacher_forced": float(np.mean([t["teacher_forced"] for t in per_task])),
                "tasks": len(per_task),
            }
        )
    return rows


def distance_table(results: Sequence[dict]) -> list[dict]:
    """Copy-at-distance: score of the repeat and token accuracy of its first occurrence per
    log2 distance bucket [2^k, 2^(k+1)): the curve over d."""
    copies = [r for r in results if r.get("distance") is not None]
    buckets: dict[int, list[dict]] = {}
    for r in copies:
        buckets.setdefault(1 << max(0, int(r["distance"]).bit_length() - 1), []).append(r)
    return [
        {
            **_cell({"task": rows[0]["task"], "distance_bucket": start}, rows),
            "mean_distance": float(np.mean([r["distance"] for r in rows])),
            "reference_token_accuracy": float(
                np.mean([r["reference_token_accuracy"] for r in rows])
            ),
        }
        for start, rows in sorted(buckets.items())
    ]


# -------------------------------------------------------------------- effective length
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


def ruler_task_names(results: Sequence[dict]) -> list[str]:
    """The RULER tasks among the results (their mean is RULER's suite score)."""
    return [t for t in RULER_TASK_NAMES if any(r["task"] == t for r in results)]


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
    ruler_tasks = ruler_task_names(results)
    out: dict = {"ruler": None, "relative": None}
    if ruler_tasks:
        scores = suite_scores(results, ruler_tasks)
        missing = [t for t in RULER_TASK_NAMES if t not in ruler_tasks]
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


def summarize(results: Sequence[dict], anchor: int | None = None) -> dict:
    """The whole report of one scoring: cells, per-length rows, the copy curve, effective
    lengths (RULER's; the relative one when ``anchor``, the training length, is given)."""
    return {
        "scoring": sorted({r["scoring"] for r in results}),
        "cells": cell_table(results),
        "lengths": length_table(results),
        "suite": suite_table(results),
        "copy_curve": distance_table(results),
        "effective_length": effective_lengths(results, anchor),
    }
