"""data.dp_balance in the train stream: each optimizer step trains the same rows as without it,
in the balancer's (rank, micro-batch) slots, identically on every rank, and a resume (on the
same or another data-parallel size) replays the same balanced order."""

from __future__ import annotations

import pytest
from data_fixtures import small_corpus, take

from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.dp_balance import RowCost, balance_step, unbalanced_step
from longctx.data.streams import merge_rank_states, pad_lengths
from longctx.errors import LongctxError

COST = RowCost(1.0, 0.05)  # attention matters: rows of one long document cost the most
CONFIG = dict(seq_len=64, micro_batch_size=2, buffer_size=8, chunk_documents=24, num_streams=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"), 300)


def ranks(folder, world: int, accumulation: int, balance: bool = True, **config):
    return [
        LongCtxDataModule(
            DataConfig(shards=[str(folder)], dp_balance=balance, **{**CONFIG, **config}),
            rank=r,
            world_size=world,
            accumulate_grad_batches=accumulation,
            row_cost=COST if balance else None,
        )
        for r in range(world)
    ]


def steps(modules, accumulation: int, count: int) -> list[list[list[tuple]]]:
    """[step][rank] -> the rows (token tuples) rank trains in the step, in micro-batch order."""
    per_rank = [take(dm, accumulation * count) for dm in modules]
    return [
        [
            [
                tuple(row)
                for b in batches[s * accumulation : (s + 1) * accumulation]
                for row in b.tokens.tolist()
            ]
            for batches in per_rank
        ]
        for s in range(count)
    ]


def rows_of(step) -> list[tuple]:
    return sorted(row for rank in step for row in rank)


@pytest.mark.parametrize("world,accumulation,workers", [(2, 2, 0), (2, 3, 0), (3, 2, 2), (1, 4, 0)])
def test_a_balanced_step_trains_the_same_rows_in_the_planned_slots(
    folder, world, accumulation, workers
):
    plain = steps(
        ranks(folder, world, accumulation, balance=False, num_workers=workers), accumulation, 4
    )
    modules = ranks(folder, world, accumulation, num_workers=workers)
    balanced = steps(modules, accumulation, 4)
    again = steps(ranks(folder, world, accumulation, num_workers=workers), accumulation, 4)
    assert balanced == again  # deterministic
    moved = 0
    for before, after in zip(plain, balanced, strict=True):
        assert rows_of(before) == rows_of(after)  # the same rows, so the same tokens
        moved += before != after
    assert moved  # the order did change somewhere


def test_the_step_follows_the_balancers_plan_and_lowers_the_imbalance(folder):
    world, accumulation, b = 2, 3, CONFIG["micro_batch_size"]
    plain = take(ranks(folder, 1, world * accumulation, balance=False)[0], world * accumulation * 3)
    balanced = [take(dm, accumulation * 3) for dm in ranks(folder, world, accumulation)]
    per_step = world * accumulation
    better = 0
    for s in range(3):
        # global order: micro-batch u of the step is plain[s * per_step + u]
        batches = plain[s * per_step : (s + 1) * per_step]
        rows = [row for batch in batches for row in batch.tokens.tolist()]
        lens = pad_lengths([n[n > 0].numpy() for batch in batches for n in batch.seq_lens])
        costs = COST.costs(lens)
        plan = balance_step(costs, world, accumulation, b)
        for r in range(world):
            for m in range(accumulation):
                got = balanced[r][s * accumulation + m].tokens.tolist()
                assert got == [rows[i] for i in plan.slots[r, m]]
        before = unbalanced_step(costs, world, accumulation, b)
        assert plan.step_time <= before.step_time * (1 + 1e-12)
        better += plan.step_time < before.step_time * (1 - 1e-9)
    assert better


@pytest.mark.parametrize("rounds", [4, 5])  # at a step boundary, and inside a step
def test_resume_replays_the_same_balanced_order(folder, rounds):
    world, accumulation = 2, 2
    full = [take(dm, 10) for dm in ranks(folder, world, accumulation)]
    first = ranks(folder, world, accumulation)
    got = [take(dm, rounds) for dm in first]
    state = merge_rank_states([dm.state_dict() for dm in first])
    resumed = ranks(folder, world, accumulation)
    for dm in resumed:
        dm.load_state_dict(state)
    got = [a + take(dm, 10 - rounds) for a, dm in zip(got, resumed, strict=True)]
    for a, b in zip(got, full, strict=True):
        assert [x.tokens.tolist() for x in a] == [x.tokens.tolist() for x in b]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_elastic_resume_replays_the_balanced_order_of_the_new_size(folder, before, after):
    """On another data-parallel size the checkpoint's global batch is kept (4 micro-batches per
    step: accumulation 4 / before here), and each step after the resume is the step an
    uninterrupted run on the new size trains: the same rows, balanced over the new slots."""
    per_step = 4
    state_steps = 2
    first = ranks(folder, before, per_step // before)
    for dm in first:
        take(dm, state_steps * per_step // before)
    state = merge_rank_states([dm.state_dict() for dm in first])
    resumed = ranks(folder, after, 1)  # configured accumulation 1: the checkpoint's is kept
    for dm in resumed:
        dm.load_state_dict(state)
        assert dm.micro_batches_per_step() == per_step
    got = steps(resumed, per_step // after, 3)
    fresh = steps(ranks(folder, after, per_step // after), per_step // after, state_steps + 3)
    assert got == fresh[state_steps:]
    old = steps(ranks(folder, before, per_step // before), per_step // before, state_steps + 3)
    assert [rows_of(s) for s in got] == [rows_of(s) for s in old[state_steps:]]


def test_a_changed_global_batch_balances_steps_from_the_resume(folder):
    first = ranks(folder, 2, 3)  # 6 micro-batches per step
    for dm in first:
        take(dm, 3)
    state = merge_rank_states([dm.state_dict() for dm in first])
    resumed = ranks(folder, 4, 1)  # 6 / 4 rounds to accumulation 2: 8 per step, from here
    for dm in resumed:
        dm.load_state_dict(state)
        assert dm.step_balance().micro_batches_per_step == 8
        assert dm.step_balance().anchor == 6
    plain = ranks(folder, 1, 8, balance=False)[0]
    rows = [r for b in take(plain, 6 + 16)[6:] for r in b.tokens.tolist()]  # after 6 micro-batches
    got = steps(resumed, 2, 2)
    assert [rows_of(s) for s in got] == [
        sorted(tuple(r) for r in rows[i * 16 : (i + 1) * 16]) for i in range(2)
    ]


def test_balancing_without_a_row_cost_is_refused(folder):
    with pytest.raises(LongctxError, match="dp_balance=true and no row cost"):
        LongCtxDataModule(DataConfig(shards=[str(folder)], dp_balance=True))
    with pytest.raises(LongctxError, match="DataConfig.dp_balance='yes'; expected true or false"):
        DataConfig(dp_balance="yes")
