"""Data-parallel balance: which (rank, micro-batch) slot of an optimizer step trains each row.

Every optimizer step waits for its slowest data-parallel rank, and under document masks the
rows of a step differ widely in cost. Balancing reorders the step's rows over the ranks and
their accumulation micro-batches; the step's rows, and so its tokens, loss and gradients, are
the same. Deterministic (ties broken by global row index), so every rank computes the identical
assignment. Pure numpy, below the model, so the train stream balances with it. The cost model
and the partition (LPT, then pairwise swaps): docs/dp-balance.md.

Slot order is the datamodule's (longctx/data/streams.py): in accumulation round m, rank r
trains global micro-batch ``m * R + r``; unbalanced, slot (r, m, p) holds the step's global
row ``(m * R + r) * b + p`` (:func:`unbalanced_step`).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

import numpy as np

from longctx.errors import LongctxError, is_number

# A swap must lower the pair's maximum by more than this fraction of it (float noise is no gain).
SWAP_TOLERANCE = 1e-12
# Swaps stop once the most loaded part is within this fraction of the mean: finer than the cost
# model can tell apart, and at 16k rows the last 0.1% took seconds of swaps.
EVEN_ENOUGH = 1e-3


@dataclasses.dataclass(frozen=True)
class RowCost:
    """Predicted seconds of one row: ``linear_per_token * L + attention_per_sq_token *
    sum(l_i^2)`` over the row's segment lengths ``l_i`` (one segment of L without a document
    mask)."""

    linear_per_token: float
    attention_per_sq_token: float

    def __post_init__(self) -> None:
        for name in ("linear_per_token", "attention_per_sq_token"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise LongctxError(f"RowCost {name}={value!r}; expected a finite number >= 0")

    def cost(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        """One row's cost from its segment lengths (zero padding allowed)."""
        lens = _lengths(seq_lens, 1, "[segments]")
        return float(self.costs(lens[None, :])[0])

    def costs(self, seq_lens_BS, document_mask: bool = True) -> np.ndarray:
        """Costs [B] of rows with segment lengths [B, S] (zero padded, the PackedBatch field);
        without a document mask a row attends as one segment of its whole length."""
        lens = _lengths(seq_lens_BS, 2, "[rows, segments]")
        tokens = lens.sum(axis=1)
        squares = (lens**2).sum(axis=1) if document_mask else tokens**2
        return self.linear_per_token * tokens + self.attention_per_sq_token * squares


def lpt_partition(costs: np.ndarray, parts: int, size: int) -> np.ndarray:
    """Longest processing time first with room: rows by decreasing cost (ties: lower index),
    each to the least loaded part that has fewer than ``size`` rows (ties: lower part).
    Returns [parts, size] indices into ``costs``."""
    order = np.lexsort((np.arange(len(costs)), -costs))
    heap = [(0.0, part) for part in range(parts)]  # (load, part) of parts with room
    members: list[list[int]] = [[] for _ in range(parts)]
    for row in order.tolist():
        load, part = heapq.heappop(heap)
        members[part].append(row)
        if len(members[part]) < size:
            heapq.heappush(heap, (load + float(costs[row]), part))
    return np.array(members, dtype=np.int64).reshape(parts, size)


def improve_by_swaps(costs: np.ndarray, groups: np.ndarray, max_swaps: int) -> np.ndarray:
    """Swap a row of the most loaded part with one of another part while that lowers the pair's
    maximum; each time the swap that evens the pair best (ties: lower part, then position).
    The most loaded part never gets costlier, so the result is never worse than the start.
    Stops once it is within EVEN_ENOUGH of the mean."""
    groups = groups.copy()
    loads = costs[groups].sum(axis=1)
    even = loads.mean() * (1 + EVEN_ENOUGH)
    for _ in range(max_swaps):
        top = int(np.argmax(loads))
        if loads[top] <= even:
            break
        delta = costs[groups[top]][None, :, None] - costs[groups][:, None, :]  # [P, K, K]
        pair_max = np.maximum(loads[top] - delta, loads[:, None, None] + delta)
        pair_max[top] = np.inf
        best = int(np.argmin(pair_max))
        if not pair_max.flat[best] < loads[top] * (1 - SWAP_TOLERANCE):
            break
        other, i, j = np.unravel_index(best, pair_max.shape)
        groups[top, i], groups[other, j] = groups[other, j], groups[top, i]
        loads[top], loads[other] = costs[groups[top]].sum(), costs[groups[other]].sum()
    return groups


def partition(
    costs: np.ndarray, parts: int, size: int, improve: bool = True, given: np.ndarray | None = None
) -> np.ndarray:
    """``parts`` groups of exactly ``size`` rows, the costliest group as cheap as found: LPT,
    then (``improve``) pairwise swaps, from LPT's groups and from the ``given`` ones (today's
    order: so never worse than it either), the better kept (ties: LPT's). Returns [parts, size]
    indices into ``costs``, each group's in increasing order."""
    groups = lpt_partition(costs, parts, size)
    if improve and parts > 1 and size > 1:
        groups = improve_by_swaps(costs, groups, max_swaps=parts * size)
        peak = costs[groups].sum(axis=1).max()
        if given is not None and peak > costs.sum() / parts * (1 + EVEN_ENOUGH):
            other = improve_by_swaps(costs, given, max_swaps=parts * size)
            groups = other if costs[other].sum(axis=1).max() < peak else groups
    return np.sort(groups, axis=1)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One optimizer step's assignment: ``slots[r, m, p]`` is the step's global row index that
    rank r trains at position p of its micro-batch m (a permutation of 0 .. R*M*b - 1)."""

    slots: np.ndarray  # int64 [R, M, b]
    costs: np.ndarray  # float64 [R*M*b], the step's row costs in global row order

    @property
    def micro_batch_costs(self) -> np.ndarray:
        """[R, M]: each micro-batch's cost."""
        return self.costs[self.slots].sum(axis=2)

    @property
    def rank_costs(self) -> np.ndarray:
        """[R]: each rank's cost over the step."""
        return self.micro_batch_costs.sum(axis=1)

    @property
    def imbalance(self) -> float:
        """max / mean of the rank costs: ``train/dp_work_imbalance``."""
        return imbalance(self.rank_costs)

    @property
    def step_time(self) -> float:
        """The step when ranks meet once per step (DDP, no sync in accumulation): the most
        loaded rank's cost."""
        return float(self.rank_costs.max())

    @property
    def round_synced_step_time(self) -> float:
        """The step when ranks meet at every micro-batch (FSDP2 gathers parameters per layer):
        the sum over accumulation rounds of the costliest rank's micro-batch."""
        return float(self.micro_batch_costs.max(axis=0).sum())

    @property
    def order(self) -> np.ndarray:
        """The permutation in the datamodule's global micro-batch order: entry
        ``(m * R + r) * b + p`` is the global row at slot (r, m, p)."""
        return self.slots.transpose(1, 0, 2).reshape(-1)


def balance_step(
    costs, ranks: int, micro_batches: int, rows_per_micro_batch: int, improve: bool = True
) -> StepPlan:
    """The balanced assignment of one step's rows (``costs`` in global row order) to ``ranks``
    x ``micro_batches`` slots of ``rows_per_micro_batch`` rows. ``improve=False``: LPT alone."""
    today = unbalanced_step(costs, ranks, micro_batches, rows_per_micro_batch)
    costs, per_rank = today.costs, micro_batches * rows_per_micro_batch
    slots = np.empty_like(today.slots)
    given = today.slots.reshape(ranks, per_rank)
    for r, rows in enumerate(partition(costs, ranks, per_rank, improve, given)):
        micro = rows[partition(costs[rows], micro_batches, rows_per_micro_batch, improve)]
        # costliest micro-batch first (ties: lower first row), so ranks' rounds line up
        slots[r] = micro[np.lexsort((micro[:, 0], -costs[micro].sum(axis=1)))]
    return StepPlan(slots, costs)


def unbalanced_step(costs, ranks: int, micro_batches: int, rows_per_micro_batch: int) -> StepPlan:
    """Today's order (longctx/data/streams.py): in round m rank r trains global micro-batch
    ``m * R + r``."""
    costs = check_step(costs, ranks, micro_batches, rows_per_micro_batch)
    rows = np.arange(len(costs)).reshape(micro_batches, ranks, rows_per_micro_batch)
    return StepPlan(rows.transpose(1, 0, 2).copy(), costs)


def imbalance(rank_costs) -> float:
    """max / mean of per-rank costs (1.0 = even; 1.0 for all-zero costs)."""
    costs = np.asarray(rank_costs, dtype=np.float64)
    if costs.ndim != 1 or not len(costs) or not np.isfinite(costs).all() or (costs < 0).any():
        raise ValueError(f"rank costs {costs.tolist()}; expected one finite cost >= 0 per rank")
    mean = costs.mean()
    return float(costs.max() / mean) if mean > 0 else 1.0


def max_lower_bound(costs, ranks: int, rows_per_rank: int) -> float:
    """No assignment of ``costs`` to ``ranks`` ranks of ``rows_per_rank`` rows makes the most
    loaded rank cost less than this: the mean, and for j = 0 .. K-1 (K = rows_per_rank) the
    pigeonhole over the j*R + 1 costliest rows (some rank holds j + 1 of them, at least the
    j + 1 cheapest of them, plus the K - j - 1 cheapest rows of the step). j = 0: the costliest
    row plus the K - 1 cheapest rows."""
    costs = check_step(costs, ranks, 1, rows_per_rank)
    c = np.sort(costs)[::-1]
    bound = c.sum() / ranks
    for j in range(rows_per_rank):
        top = c[j * ranks - j : j * ranks + 1].sum()
        rest = c[len(c) - (rows_per_rank - j - 1) :].sum() if rows_per_rank - j - 1 else 0.0
        bound = max(bound, top + rest)
    return float(bound)


def check_step(costs, ranks: int, micro_batches: int, rows_per_micro_batch: int) -> np.ndarray:
    """The costs as float64 [R*M*b], or a ValueError naming the value that is wrong."""
    for name, value in (
        ("data-parallel ranks", ranks),
        ("micro_batches per rank", micro_batches),
        ("rows_per_micro_batch", rows_per_micro_batch),
    ):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ValueError(f"dp balance: {name}={value!r}; expected an integer >= 1")
    array = _array(costs)
    if array.ndim != 1 or array.dtype.kind not in "iuf":
        raise ValueError(
            f"dp balance: row costs of shape {array.shape} and dtype {array.dtype}; expected a "
            "1-D sequence of numbers"
        )
    array = array.astype(np.float64)
    slots = ranks * micro_batches * rows_per_micro_batch
    if len(array) != slots:
        raise ValueError(
            f"dp balance: {len(array)} rows in the step; expected ranks x micro_batches x "
            f"rows_per_micro_batch = {ranks} x {micro_batches} x {rows_per_micro_batch} = {slots}"
        )
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if len(bad):
        raise ValueError(
            f"dp balance: row {int(bad[0])} costs {float(array[bad[0]])!r}; expected a finite cost >= 0"
        )
    with np.errstate(over="ignore"):
        total = array.sum()
    if not np.isfinite(total):
        raise ValueError(f"dp balance: the row costs sum to {total}; expected a finite total")
    return array


def _array(values) -> np.ndarray:
    """``values`` as an array; ragged ones as an object array (numpy's own error would not say
    which input it was)."""
    try:
        return np.asarray(values)
    except ValueError:
        return np.asarray(values, dtype=object)


def _lengths(seq_lens, ndim: int, shape: str) -> np.ndarray:
    """Segment lengths as float64 of ``ndim`` dimensions, each finite and >= 0, or a
    ValueError that says what they were."""
    lens = _array(seq_lens)
    if lens.dtype.kind not in "iuf" or lens.ndim != ndim or not np.isfinite(lens).all():
        raise ValueError(
            f"seq_lens of shape {lens.shape} and dtype {lens.dtype}; expected {shape} of "
            "finite lengths >= 0"
        )
    lens = lens.astype(np.float64)
    if (lens < 0).any():
        raise ValueError(f"seq_lens has a negative length ({lens.min():g}); expected lengths >= 0")
    return lens
