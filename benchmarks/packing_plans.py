"""The packers' planning alone, for the packing and data-parallel balance benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from longctx.data.packing import PackingStats, Piece, make_packer


def plan_rows(
    name: str, lengths: Sequence[int], seq_len: int, *, buffer_size: int = 1000, seed: int = 0
) -> tuple[list[tuple[Piece, ...]], PackingStats]:
    """Planning alone: the rows a packer would build for documents of these lengths.

    Each row is a tuple of pieces ``(document index, start, length)``, a pad piece having
    document index -1; no tokens are touched (the packer's planner, without its collation).
    """
    planner = make_packer(name, seq_len, buffer_size=buffer_size, seed=seed)._planner
    plan: list[tuple[Piece, ...]] = []
    for doc, length in enumerate(lengths):
        planner.add(doc, length)
        if planner.ready:
            plan.extend(planner.ready)
            planner.ready.clear()
    planner.flush()
    plan.extend(planner.ready)
    stats = PackingStats()
    for pieces in plan:
        stats.record(pieces, lengths.__getitem__)
    return plan, stats
