"""Data-parallel balance in the plan: the row cost that training balances with
(:func:`row_cost_for`: the planner's own step-time model) and what balancing is predicted to do
to a step of the layout's rows (:func:`expected_dp_balance`).

The balancer itself is ``longctx.data.dp_balance`` (pure numpy, below the model, so the train
stream balances with it); here its cost model takes the planner's coefficients.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from longctx.data.dp_balance import RowCost
from longctx.errors import LongctxError
from longctx.model.flops import matmul_params, training_flops


def row_cost_for(config, device, mfu: float) -> RowCost:
    """The planner's step-time model as a row cost for ``config`` (a LlamaConfig) on ``device``
    (a ``longctx.planner.Device``: its ``peak_flops``) at ``mfu`` (``planner.mfu``): the
    training FLOPs of one token and of one squared in-document token, over peak x MFU.

    Per GPU of a data-parallel rank; a context-parallel group of c GPUs divides it by c."""
    peak = getattr(device, "peak_flops", None)
    if not _is_number(peak) or not math.isfinite(peak) or peak <= 0:
        raise LongctxError(
            f"peak FLOP/s of the device ({peak!r}); expected a finite positive number "
            "(set peak_flops_per_device)"
        )
    if not _is_number(mfu) or not 0 < mfu <= 1:
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


def _is_number(value) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
