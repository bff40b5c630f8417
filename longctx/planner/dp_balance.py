"""Data-parallel balance in the plan: the row cost that training balances with
(:func:`row_cost_for`: the planner's own step-time model) and what balancing is predicted to do
to a step of the layout's rows (:func:`expected_dp_balance`).

The balancer itself is ``longctx.data.dp_balance`` (pure numpy, below the model, so the train
stream balances with it); here its cost model takes the planner's coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from longctx.data.dp_balance import RowCost, balance_step, unbalanced_step
from longctx.errors import LongctxError, is_number
from longctx.model.flops import matmul_params, training_flops
from longctx.planner.capacity import CapacityPlan
from longctx.planner.layout import documents_note, lognormal_row, row_lengths

SAMPLE_STEPS = 8  # steps drawn from the stated length distribution
SAMPLE_ROWS = 2048  # at most this many rows drawn (fewer steps at many ranks x accumulation)


@dataclass(frozen=True)
class DpBalance:
    """What data.dp_balance is predicted to do to the layout's steps: max / mean of the
    data-parallel ranks' row cost (train/dp_work_imbalance) and the step time (the slowest
    rank's compute; FSDP2 traffic and the K/V gather as the plan has them), before and after,
    means over ``steps`` steps of rows drawn from the plan's document lengths."""

    ranks: int
    rows_per_rank: int
    steps: int
    imbalance_before: float
    imbalance_after: float
    step_s_before: float
    step_s_after: float
    documents: str
    enabled: bool  # data.dp_balance

    @property
    def speedup(self) -> float:
        return self.step_s_before / self.step_s_after


def expected_dp_balance(config, plan: CapacityPlan, enabled: bool) -> DpBalance | None:
    """The plan's steps balanced and not (None without a step time): the rows the plan is made
    for (its documents: one per row, or the stated lognormal lengths packed in order), R x M x b
    per step (R = the data-parallel ranks)."""
    lay, step = plan.layout, plan.step
    if step is None:
        return None
    ranks = max(1, lay.world // lay.context_parallel)
    per_rank = lay.accumulate_grad_batches * lay.micro_batch_size
    per_step = ranks * per_rank
    steps = max(1, min(SAMPLE_STEPS, SAMPLE_ROWS // per_step))
    costs = row_flops_of(config, sampled_rows(lay, per_step * steps))
    before, after = [], []
    for s in range(steps):
        c = costs[s * per_step : (s + 1) * per_step]
        args = (ranks, lay.accumulate_grad_batches, lay.micro_batch_size)
        before.append(unbalanced_step(c, *args).imbalance)
        after.append(balance_step(c, *args).imbalance)
    b, a = float(np.mean(before)), float(np.mean(after))
    wait = lambda i: max(step.compute_s * i, step.fsdp_s) + step.kv_s  # noqa: E731
    return DpBalance(
        ranks, per_rank, steps, b, a, wait(b), wait(a), documents_note(lay), enabled
    )  # fmt: skip


def sampled_rows(layout, count: int) -> np.ndarray:
    """[count, S] segment lengths of rows the plan is made for (seeded)."""
    if layout.doc_length_lognormal is None:
        rows = [np.array(row_lengths(layout))] * count
    else:
        rng = np.random.default_rng(0)
        median, sigma = layout.doc_length_lognormal
        rows = [lognormal_row(layout.seq_len, median, sigma, rng) for _ in range(count)]
    out = np.zeros((count, max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def row_flops_of(config, seq_lens: np.ndarray) -> np.ndarray:
    """Training FLOPs of each row (the ratio is what balancing needs)."""
    return RowCost(*row_flops(config)).costs(seq_lens)


def format_dp_balance(balance: DpBalance) -> str:
    """Two lines for the dry run: the imbalance and the step, without and with balancing."""
    state = "on" if balance.enabled else "off"
    return (
        f"  data-parallel balance (data.dp_balance={state}; {balance.ranks} ranks x "
        f"{balance.rows_per_rank} rows per step, {balance.documents}, {balance.steps} steps "
        f"sampled): rank work max/mean {balance.imbalance_before:.3f} unbalanced, "
        f"{balance.imbalance_after:.3f} balanced\n"
        f"  step (the slowest rank): {balance.step_s_before:.3f} s unbalanced, "
        f"{balance.step_s_after:.3f} s balanced ({balance.speedup:.2f}x)"
    )


def row_cost_for(config, device, mfu: float) -> RowCost:
    """The planner's step-time model as a row cost for ``config`` (a LlamaConfig) on ``device``
    (a ``longctx.planner.Device``: its ``peak_flops``) at ``mfu`` (``planner.mfu``): the
    training FLOPs of one token and of one squared in-document token, over peak x MFU.

    Per GPU of a data-parallel rank; a context-parallel group of c GPUs divides it by c."""
    peak = getattr(device, "peak_flops", None)
    if not is_number(peak) or not math.isfinite(peak) or peak <= 0:
        raise LongctxError(
            f"peak FLOP/s of the device ({peak!r}); expected a finite positive number "
            "(set peak_flops_per_device)"
        )
    if not is_number(mfu) or not 0 < mfu <= 1:
        raise LongctxError(f"planner.mfu={mfu!r}; expected a fraction in (0, 1]")
    linear, attention = row_flops(config)
    throughput = peak * mfu
    return RowCost(linear / throughput, attention / throughput)


def training_row_cost(
    config, peak_flops: float | None, mfu: float, context_parallel: int = 1
) -> RowCost | None:
    """What a training run balances and logs with (data.dp_balance, train/dp_work_imbalance):
    :func:`row_cost_for` on one GPU of a context-parallel group (1/c of a row's work), in
    seconds where the peak is known, else in FLOPs (the balance and the imbalance are ratios:
    the same either way). None for a model the planner's FLOP model does not cover."""
    if not getattr(config, "plans_capacity", False):
        return None
    linear, attention = row_flops(config)
    throughput = (peak_flops * mfu if peak_flops else 1.0) * context_parallel
    return RowCost(linear / throughput, attention / throughput)


def row_flops(config) -> tuple[float, float]:
    """(training FLOPs of one token, of one squared in-document token) of ``config``
    (``longctx.model.flops.training_flops``, the planner's formula)."""
    one_token = torch.ones(1, 1)
    linear = training_flops(matmul_params(config), 0, 0, 0, one_token)
    attention = training_flops(0, config.head_dim, config.n_heads, config.n_layers, one_token)
    return linear, attention
