"""Context-parallel balance beyond bench_cp.py's one length distribution: documents against
head_tail for lognormal documents of several medians, on 8 to 32 ranks.

Pure arithmetic on the plans (no model, no timing but the planning itself): per (row length,
median, ranks), 16 rows drawn by the planner's own sampler (longctx.planner.layout.lognormal_row,
sigma 1.0, seeded), the work imbalance max / min and max / mean over ranks of in-document causal
pairs (mean / worst row), pieces of split documents per rank, and planning milliseconds per row.

    .venv/bin/python benchmarks/bench_cp_lengths.py     # -> results/cp_lengths.json, ~10 s
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from longctx.cp_balance import plan_stats, row_owner
from longctx.planner.layout import lognormal_row

RESULTS = Path(__file__).parent / "results"
LENGTHS = (32768, 131072)
MEDIANS = (100, 600, 4000, 16000)
SIZES = (8, 16, 32)
ROWS = 16
SIGMA = 1.0


def measure(length: int, median: int, size: int, balance: str) -> dict:
    rng = np.random.default_rng(1)
    rows = [lognormal_row(length, median, SIGMA, rng) for _ in range(ROWS)]
    started = time.perf_counter()
    owners = [row_owner(r, size, balance) for r in rows]
    plan_ms = (time.perf_counter() - started) / ROWS * 1e3
    stats = [plan_stats([r], [o], size) for r, o in zip(rows, owners, strict=True)]
    max_min = [max(s.work) / min(s.work) for s in stats]
    max_mean = [s.work_imbalance for s in stats]
    return {
        "max_min": {"mean": statistics.fmean(max_min), "worst": max(max_min)},
        "max_mean": {"mean": statistics.fmean(max_mean), "worst": max(max_mean)},
        "pieces_per_rank": statistics.fmean(s.pieces_per_rank for s in stats),
        "plan_ms_per_row": plan_ms,
    }


def main() -> None:
    started = time.perf_counter()
    rows = [
        {"L": n, "median": m, "ranks": size}
        | {b: measure(n, m, size, b) for b in ("head_tail", "documents")}
        for n in LENGTHS
        for m in MEDIANS
        for size in SIZES
    ]
    print("max / min over ranks of in-document pairs, mean / worst row; pieces per rank")
    print(f"{'L':>7} {'median':>6} {'ranks':>5} {'head_tail':>22} {'documents':>22} {'plan ms':>8}")
    for r in rows:
        cells = " ".join(
            f"{r[b]['max_min']['mean']:>6.3f} /{r[b]['max_min']['worst']:>7.3f} "
            f"{r[b]['pieces_per_rank']:>4.1f}p"
            for b in ("head_tail", "documents")
        )
        print(
            f"{r['L']:>7} {r['median']:>6} {r['ranks']:>5} {cells} "
            f"{r['documents']['plan_ms_per_row']:>8.1f}"
        )
    config = {
        "rows": ROWS,
        "sigma": SIGMA,
        "sampler": "longctx.planner.layout.lognormal_row, numpy default_rng(1)",
        "machine": platform.machine(),
        "wall_s": time.perf_counter() - started,
    }
    out = RESULTS / "cp_lengths.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "config": config}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
