"""Tables of the scored rows: per cell, per length, the suite, the copy-at-distance curve.

Each cell (task x length x depth) reports the mean score with a 95% Wilson score interval.
The cells are small and often at 0 or 1, where the normal interval collapses to a point and a
bootstrap over so few instances returns the observed proportion again. For partial credit
(string_match_all) the interval is conservative: a score in [0, 1] with mean p has variance at
most p (1 - p), the binomial's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054


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
