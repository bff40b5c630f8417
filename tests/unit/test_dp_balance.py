"""The data-parallel balancer (longctx.data.dp_balance): a permutation of the step's rows,
deterministic, never worse than LPT, and its cost model the planner's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from longctx import planner
from longctx.data.dp_balance import (
    RowCost,
    balance_step,
    imbalance,
    lpt_partition,
    max_lower_bound,
    unbalanced_step,
)
from longctx.model import LlamaConfig
from longctx.model.flops import matmul_params
from longctx.planner.dp_balance import row_cost_for
from longctx.planner.layout import row_lengths
from longctx.planner.step_time import step_time

SHAPES = [(2, 1, 1), (2, 3, 1), (8, 1, 2), (8, 4, 1), (3, 2, 3), (64, 4, 1), (16, 2, 4)]


def long_tailed(n: int, seed: int) -> np.ndarray:
    """Row costs of a long-tailed mix: mostly cheap rows, a few several times costlier."""
    rng = np.random.default_rng(seed)
    return 1.0 + rng.pareto(1.5, n) * rng.choice([0.1, 1.0, 5.0], n)


def lpt_max(costs: np.ndarray, ranks: int, rows_per_rank: int) -> float:
    return costs[lpt_partition(costs, ranks, rows_per_rank)].sum(axis=1).max()


def brute_force_max(costs: np.ndarray, ranks: int, rows_per_rank: int) -> float:
    """The optimum over every split into ranks of rows_per_rank rows (tiny cases only)."""
    best = np.inf
    for perm in itertools.permutations(range(len(costs))):
        loads = costs[list(perm)].reshape(ranks, rows_per_rank).sum(axis=1)
        best = min(best, loads.max())
    return best


@pytest.mark.parametrize("shape", SHAPES)
def test_a_permutation_of_the_steps_rows(shape):
    ranks, micro, b = shape
    costs = long_tailed(ranks * micro * b, seed=1)
    plan = balance_step(costs, ranks, micro, b)
    assert plan.slots.shape == shape
    assert sorted(plan.order.tolist()) == list(range(len(costs)))
    assert plan.rank_costs.sum() == pytest.approx(costs.sum())
    # order is the datamodule's global micro-batch order: entry (m * R + r) * b + p
    r, m, p = ranks - 1, micro - 1, b - 1
    assert plan.order[(m * ranks + r) * b + p] == plan.slots[r, m, p]


def test_unbalanced_is_the_datamodules_order():
    """streams.py: in round m rank r trains global micro-batch m * R + r."""
    plan = unbalanced_step(np.ones(12), ranks=3, micro_batches=2, rows_per_micro_batch=2)
    assert plan.slots[1, 0].tolist() == [2, 3]  # micro-batch 1
    assert plan.slots[1, 1].tolist() == [8, 9]  # micro-batch 3 + 1 = 4
    assert plan.order.tolist() == list(range(12))


def test_deterministic_and_ties_by_row_index():
    costs = long_tailed(64 * 4, seed=2)
    costs[::7] = costs[0]  # many ties
    first = balance_step(costs, 64, 4, 1)
    again = balance_step(costs.copy(), 64, 4, 1)
    assert np.array_equal(first.slots, again.slots)
    # two equal rows: the lower index goes first, to rank 0
    assert balance_step([1.0, 1.0], 2, 1, 1).slots[:, 0, 0].tolist() == [0, 1]


@pytest.mark.parametrize("shape", SHAPES)
def test_never_worse_than_lpt_nor_below_the_bound(shape):
    ranks, micro, b = shape
    for seed in range(30):
        costs = long_tailed(ranks * micro * b, seed)
        plan = balance_step(costs, ranks, micro, b)
        lpt = balance_step(costs, ranks, micro, b, improve=False)
        assert lpt.step_time == pytest.approx(lpt_max(costs, ranks, micro * b))
        assert plan.step_time <= lpt.step_time * (1 + 1e-12)
        assert plan.step_time >= max_lower_bound(costs, ranks, micro * b) * (1 - 1e-12)
        assert plan.step_time <= unbalanced_step(costs, ranks, micro, b).step_time * (1 + 1e-12)


def test_better_than_lpt_where_lpt_is_not_optimal():
    """LPT puts 3 | 3, 2 | 2, then the third 2 on the rank with room and least load: 7 | 5.
    The optimum is {3, 3, 0} | {2, 2, 2} = 6 | 6, which one swap finds."""
    costs = np.array([3.0, 3.0, 2.0, 2.0, 2.0, 0.0])
    lpt = balance_step(costs, 2, 3, 1, improve=False)
    plan = balance_step(costs, 2, 3, 1)
    assert lpt.step_time == 7.0
    assert plan.step_time == 6.0 == brute_force_max(costs, 2, 3)
    assert plan.imbalance == 1.0


def test_matches_brute_force_optimum_bounds_on_tiny_cases():
    """On 6 rows the bound never exceeds the optimum and the balancer is within 10% of it."""
    for seed in range(20):
        costs = long_tailed(6, seed)
        for ranks, per_rank in ((2, 3), (3, 2)):
            best = brute_force_max(costs, ranks, per_rank)
            assert max_lower_bound(costs, ranks, per_rank) <= best * (1 + 1e-12)
            assert balance_step(costs, ranks, per_rank, 1).step_time <= best * 1.10


def test_micro_batches_within_a_rank_are_even_and_costliest_first():
    costs = np.array([8.0, 1.0, 1.0, 4.0, 4.0, 1.0, 1.0, 8.0])  # one rank, 4 micro-batches of 2
    plan = balance_step(costs, 1, 4, 2)
    micro = plan.micro_batch_costs[0]
    assert micro.tolist() == sorted(micro.tolist(), reverse=True)
    assert micro.max() == 9.0  # {8, 1} x 2, {4, 1} x 2: no split of these rows does better


def test_equal_costs_spread_identically():
    plan = balance_step(np.full(8 * 4 * 2, 2.5), 8, 4, 2)
    assert np.all(plan.rank_costs == 2.5 * 8)
    assert np.all(plan.micro_batch_costs == 5.0)
    assert plan.imbalance == 1.0


def test_imbalance_is_max_over_mean():
    assert imbalance([1.0, 2.0, 3.0]) == 1.5
    assert imbalance([0.0, 0.0]) == 1.0
    for bad in ([], [1.0, float("nan")], [2.0, -1.0]):
        with pytest.raises(ValueError, match="expected one finite cost >= 0 per rank"):
            imbalance(bad)


def test_bound_says_where_the_target_is_impossible():
    """One row costs more than a rank's mean share: no assignment is within 1.05."""
    costs = np.array([10.0] + [1.0] * 15)
    bound = max_lower_bound(costs, 4, 4)
    assert bound == 13.0  # the costly row and the three cheapest
    assert bound / (costs.sum() / 4) > 1.05
    assert balance_step(costs, 4, 2, 2).step_time == 13.0


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (([1.0] * 7, 2, 2, 2), "7 rows"),
        (([1.0] * 8, 0, 2, 2), "ranks=0"),
        (([1.0] * 8, 2, 0, 2), "micro_batches per rank=0"),
        (([1.0] * 8, 2, 2, -1), "rows_per_micro_batch=-1"),
        (([1.0] * 8, 2.0, 2, 2), "ranks=2.0"),
        (([1.0] * 8, True, 2, 4), "ranks=True"),
        (([1.0] * 3 + [float("nan")] + [1.0] * 4, 2, 2, 2), "row 3 costs nan"),
        (([1.0] * 3 + [float("inf")] + [1.0] * 4, 2, 2, 2), "row 3 costs inf"),
        (([1.0] * 7 + [-0.5], 2, 2, 2), "row 7 costs -0.5"),
        (([[1.0] * 4] * 2, 2, 2, 1), "shape (2, 4)"),
        ((["a"] * 4, 2, 2, 1), "dtype <U1"),
    ],
)
def test_bad_steps_are_refused_naming_the_value(args, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        balance_step(*args)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(linear_per_token=-1.0, attention_per_sq_token=1.0), "linear_per_token=-1.0"),
        (dict(linear_per_token=1.0, attention_per_sq_token=float("nan")), "=nan"),
        (dict(linear_per_token="1", attention_per_sq_token=1.0), "linear_per_token='1'"),
    ],
)
def test_bad_row_costs_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=named):
        RowCost(**kwargs)


def test_row_cost_for_refuses_an_unknown_peak_and_a_bad_mfu():
    config = LlamaConfig.from_name("tiny")
    unknown = planner.Device("cpu", 10**9, None, 0, "")
    with pytest.raises(ValueError, match=r"peak FLOP/s of the device \(None\)"):
        row_cost_for(config, unknown, 0.4)
    with pytest.raises(ValueError, match="planner.mfu=1.5"):
        row_cost_for(config, planner.known_device("H100"), 1.5)


def test_cost_of_a_row_and_without_document_mask():
    cost = RowCost(linear_per_token=2.0, attention_per_sq_token=0.5)
    assert cost.cost([3, 1, 0]) == 2.0 * 4 + 0.5 * (9 + 1)
    masked, unmasked = cost.costs([[3, 1], [4, 0]]), cost.costs([[3, 1], [4, 0]], False)
    assert masked.tolist() == [13.0, 16.0]
    assert unmasked.tolist() == [16.0, 16.0]
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        cost.costs([3, 1, 0])


@pytest.mark.parametrize("lengths", [(32768,), (1000, 3000, 250), (600,)])
def test_cost_is_the_planners_step_time_of_the_row(lengths):
    """Llama 3 8B on an H100: the cost of a row is the planner's predicted compute time for a
    step of that one row (one rank, one micro-batch of one row, no CP)."""
    config = LlamaConfig.from_name("llama3_8b")
    device = planner.known_device("H100")
    cost = row_cost_for(config, device, planner.DEFAULT_MFU)
    assert cost.linear_per_token > 0 and cost.attention_per_sq_token > 0
    layout = planner.RunLayout(seq_len=32768, doc_lengths=lengths)
    predicted = step_time(config, layout, device, planner.DEFAULT_MFU).compute_s
    assert cost.cost(row_lengths(layout)) == pytest.approx(predicted, rel=1e-12)
    # the coefficients' ratio is the FLOP formula's: 6 * head_dim * heads * layers per squared
    # token (causal pairs l^2 / 2, QK^T and PV, forward + backward) over 6 * matmul parameters
    ratio = cost.attention_per_sq_token / cost.linear_per_token
    c = config
    assert ratio == pytest.approx(c.head_dim * c.n_heads * c.n_layers / matmul_params(c), rel=1e-12)


def test_never_worse_than_todays_order_where_lpt_and_swaps_are():
    """LPT and its swaps can end above today's order (LPT: {31, 4, 1, 1} | {17, 14, 2, 2},
    37 | 35, and no swap moves a cost of 1); the balancer also swaps from today's order
    ({2, 2, 1, 31} | {1, 14, 17, 4}, 36 | 36, the optimum), so it never ends above it."""
    costs = np.array([2.0, 1.0, 2.0, 14.0, 1.0, 17.0, 31.0, 4.0])
    assert unbalanced_step(costs, 2, 4, 1).step_time == 36.0 == brute_force_max(costs, 2, 4)
    assert balance_step(costs, 2, 4, 1, improve=False).step_time == 37.0
    assert balance_step(costs, 2, 4, 1).step_time == 36.0
    for seed in range(200):
        costs = long_tailed(6, seed)
        today = unbalanced_step(costs, 2, 3, 1).step_time
        assert balance_step(costs, 2, 3, 1).step_time <= today * (1 + 1e-12)  # summing order


@pytest.mark.parametrize(
    "seq_lens",
    [[[1, 2], [3]], [[1, "x"]], [["1", "2"]], [[True, False]], [[1, float("nan")]], [1, 2], None],
)
def test_row_costs_refuse_lengths_that_are_not_finite_numbers(seq_lens):
    with pytest.raises(ValueError, match=r"seq_lens of shape .* expected \[rows, segments\]"):
        RowCost(1.0, 1.0).costs(seq_lens)


def test_row_costs_refuse_negative_lengths_and_an_overflowing_step():
    with pytest.raises(ValueError, match=r"negative length \(-2\)"):
        RowCost(1.0, 1.0).costs([[1, -2]])
    with pytest.raises(ValueError, match="the row costs sum to inf"):
        balance_step([1e308] * 4, 2, 2, 1)
