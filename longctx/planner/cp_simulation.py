"""Context parallelism's expected work imbalance: the balancer's own plans of the layout's rows,
pure arithmetic on lengths, the same code that shards the rows in training."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from longctx.cp_balance import plan_stats, rank_unit, row_owner
from longctx.planner.layout import RunLayout, layout_rows
from longctx.planner.settings import PlanError


@dataclass(frozen=True)
class CpBalance:
    """Expected work imbalance (max / mean over the ranks of in-document causal pairs, what
    training logs as train/cp_work_imbalance) over rows, and pieces of split documents per
    rank, of the layout's balancer: its own plans of the layout's rows."""

    mean: float
    worst: float
    pieces_per_rank: float
    rows: int


@functools.cache
def expected_cp_work_imbalance(layout: RunLayout) -> CpBalance:
    """The balancer's plans of the layout's rows (:func:`layout_rows`): pure arithmetic on
    lengths, the same code that shards the rows in training."""
    size, balance = layout.context_parallel, layout.context_parallel_balance
    rounds = layout.context_parallel_rounds
    if layout.seq_len % rank_unit(size, balance, rounds):
        raise PlanError(
            f"seq_len={layout.seq_len} does not split over context_parallel={size} with "
            f"context_parallel_balance={balance} (a multiple of {rank_unit(size, balance, rounds)})"
        )
    rows = layout_rows(layout)
    stats = [plan_stats([r], [row_owner(r, size, balance, rounds)], size) for r in rows]
    imbalance = [s.work_imbalance for s in stats]
    pieces = sum(s.pieces_per_rank for s in stats) / len(stats)
    return CpBalance(sum(imbalance) / len(imbalance), max(imbalance), pieces, len(rows))
