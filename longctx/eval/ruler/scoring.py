"""Teacher-forced scoring through PackedBatch, accuracy tables with 95% CIs, effective length.

An instance is correct when the model's argmax is right on every answer token. Each cell
(task x length x depth) reports that accuracy with a 95% Wilson score interval: the cells are
small (a few to a few dozen instances) and often at 0 or 1, where the normal (Wald) interval
collapses to a point and a bootstrap over so few instances can only return the observed
proportion again; Wilson's interval is closed-form, never leaves [0, 1] and keeps its coverage
there. (Differences between arms, paired over the same instances and resampled over instances
and seeds, use the bootstrap of the ablation report: longctx.experiments.ruler_report.)

Effective length (RULER's notion, with a threshold that scales with the model): the suite score
at a length is the mean accuracy over the tasks; the threshold is
``max(FRACTION x the score at the shortest evaluated length, chance + MARGIN)``; the effective
length is the longest evaluated length up to which every length's score stays at or above it.
A model whose shortest-length score is below the floor has none. RULER's own bar is absolute
(85.6%, Llama-2-7B at 4k): a fraction of the model's own short-context score is that bar for
a model that is perfect at short range, and still says something for a 1M-parameter model
that retrieves 60% of the time, while the floor keeps a model at chance from having one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.eval.ruler.generate import chance
from longctx.eval.ruler.instances import Instance

Z95 = 1.959963984540054
FRACTION = 0.85
MARGIN = 0.2


# ----------------------------------------------------------------------------- scoring
def instance_batch(instances: Sequence[Instance], reset_position_ids: bool = True) -> PackedBatch:
    """One instance per row (one segment each); all instances must share a length."""
    lengths = {p.length for p in instances}
    if len(lengths) != 1:
        raise ValueError(f"a batch needs instances of one length, got lengths {sorted(lengths)}")
    n = lengths.pop()
    tokens = torch.from_numpy(np.stack([p.tokens[:-1] for p in instances]))
    labels = torch.from_numpy(np.stack([p.labels() for p in instances]))
    return PackedBatch.from_lengths(tokens, [[n]] * len(instances), reset_position_ids, labels)


def answer_logits(model, batch: PackedBatch) -> Tensor:
    """Logits [num_labelled_tokens, V] at the labelled positions, in row-major order.

    Uses the model's hidden states and output weight when it has them (no [B, L, V] tensor at
    long L), else its forward(batch) logits.
    """
    mask = batch.labels != IGNORE_INDEX
    if hasattr(model, "hidden_states") and hasattr(model, "output_weight"):
        h = model.hidden_states(batch)[mask]
        return torch.nn.functional.linear(h, model.output_weight)
    return model(batch)[mask]


@torch.no_grad()
def score_instances(
    model,
    instances: Sequence[Instance],
    batch_size: int = 4,
    device: str | torch.device = "cpu",
    forward_context=None,
) -> list[dict]:
    """Per instance: task, length, depth, sample, answer, correct, token_accuracy, and for copy
    the distance and the reference (first occurrence) token accuracy."""
    results = []
    for group in _batches_by_length(instances, batch_size):
        batch = instance_batch(group).to(device)
        if forward_context is None:
            logits = answer_logits(model, batch)
        else:
            with forward_context():
                logits = answer_logits(model, batch)
        predicted = logits.argmax(dim=-1).cpu()
        targets = batch.labels[batch.labels != IGNORE_INDEX].cpu()
        hits = (predicted == targets).split([p.reference_len + p.answer_len for p in group])
        for instance, hit in zip(group, hits, strict=True):
            results.append(result_row(instance, hit))
    return results


def _batches_by_length(instances: Sequence[Instance], batch_size: int) -> Iterable[list[Instance]]:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; expected >= 1")
    by_length: dict[int, list[Instance]] = {}
    for p in instances:
        by_length.setdefault(p.length, []).append(p)
    for group in by_length.values():
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def result_row(instance: Instance, hit: Tensor) -> dict:
    """``hit``: the reference's hits (if any), then the answer's, in token order."""
    reference, answer = hit[: instance.reference_len], hit[instance.reference_len :]
    return {
        "task": instance.task,
        "length": instance.length,
        "depth": instance.depth,
        "sample": instance.sample,
        "answer": instance.answer,
        "correct": bool(answer.all()),
        "token_accuracy": float(answer.float().mean()),
        "distance": instance.distance,
        "reference_token_accuracy": float(reference.float().mean()) if len(reference) else None,
    }


# ------------------------------------------------------------------------------ tables
def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (nan, nan without trials)."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the bounds
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def _cell(keys: dict, rows: list[dict]) -> dict:
    hits = sum(r["correct"] for r in rows)
    low, high = wilson(hits, len(rows))
    return {
        **keys,
        "n": len(rows),
        "accuracy": hits / len(rows),
        "ci_low": low,
        "ci_high": high,
        "token_accuracy": float(np.mean([r["token_accuracy"] for r in rows])),
    }


def _grouped(results: Sequence[dict], keys: Sequence[str]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault(tuple(r[k] for k in keys), []).append(r)
    return [_cell(dict(zip(keys, key, strict=True)), rows) for key, rows in sorted(cells.items())]


def cell_table(results: Sequence[dict]) -> list[dict]:
    """Accuracy with its 95% Wilson interval per (task, length, depth): the heat map's cells."""
    return _grouped(results, ("task", "length", "depth"))


def length_table(results: Sequence[dict]) -> list[dict]:
    """Per (task, length), over depths."""
    return _grouped(results, ("task", "length"))


def suite_table(results: Sequence[dict]) -> list[dict]:
    """Per length: the mean over tasks of each task's accuracy (every task weighs the same),
    with the Wilson interval of the pooled instances (exact when tasks have equal counts)."""
    rows = []
    for length in sorted({r["length"] for r in results}):
        at = [r for r in results if r["length"] == length]
        per_task = [t["accuracy"] for t in length_table(at)]
        pooled = _cell({"length": length}, at)
        rows.append({**pooled, "accuracy": float(np.mean(per_task)), "tasks": len(per_task)})
    return rows


def distance_table(results: Sequence[dict]) -> list[dict]:
    """Copy-at-distance: accuracy of the repeat and of its first occurrence per log2 distance
    bucket [2^k, 2^(k+1)): the curve over d."""
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
@dataclasses.dataclass(frozen=True)
class EffectiveLength:
    length: int | None  # None: below the threshold already at the shortest length
    threshold: float
    baseline: float  # the score at the shortest length
    shortest: int
    chance: float
    fraction: float = FRACTION
    margin: float = MARGIN

    @property
    def rule(self) -> str:
        return (
            f"the longest evaluated length up to which the mean task accuracy stays >= "
            f"max({self.fraction} x {self.baseline:.3f} (the score at {self.shortest}), chance "
            f"{self.chance:.3f} + {self.margin}) = {self.threshold:.3f}"
        )

    def describe(self) -> str:
        value = "none (below the threshold at every length)" if self.length is None else self.length
        return f"effective length {value}: {self.rule}"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rule": self.rule}


def effective_length(
    scores: dict[int, float],
    chance_level: float,
    fraction: float = FRACTION,
    margin: float = MARGIN,
) -> EffectiveLength:
    """The rule of the module docstring on ``{length: mean score}``."""
    if not scores:
        raise ValueError("effective_length needs scores at one length at least")
    lengths = sorted(scores)
    baseline = scores[lengths[0]]
    threshold = max(fraction * baseline, chance_level + margin)
    best = None
    for length in lengths:
        if scores[length] < threshold:
            break
        best = length
    return EffectiveLength(best, threshold, baseline, lengths[0], chance_level, fraction, margin)


def suite_effective_length(results: Sequence[dict], tasks: Sequence[str] | None = None):
    """Effective length of the suite score (mean over the tasks in ``results``)."""
    names = sorted({r["task"] for r in results}) if tasks is None else list(tasks)
    rows = [r for r in results if r["task"] in names]
    scores = {r["length"]: r["accuracy"] for r in suite_table(rows)}
    return effective_length(scores, float(np.mean([chance(n) for n in names])))


def task_effective_lengths(results: Sequence[dict]) -> dict[str, EffectiveLength]:
    out = {}
    for row_task in sorted({r["task"] for r in results}):
        rows = [r for r in length_table(results) if r["task"] == row_task]
        out[row_task] = effective_length(
            {r["length"]: r["accuracy"] for r in rows}, chance(row_task)
        )
    return out


def summarize(results: Sequence[dict]) -> dict:
    """The whole report of one scoring: cells, per-length rows, the copy curve, effective lengths."""
    suite = suite_effective_length(results)
    return {
        "cells": cell_table(results),
        "lengths": length_table(results),
        "suite": suite_table(results),
        "copy_curve": distance_table(results),
        "effective_length": suite.length,
        "effective_length_rule": suite.to_dict(),
        "task_effective_lengths": {
            k: v.to_dict() for k, v in task_effective_lengths(results).items()
        },
    }
