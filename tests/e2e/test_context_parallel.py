"""Context parallelism on CPU: the balancers' plans, attention per rank, whole models over gloo.

Single-process tests simulate every rank of a group: rank r's queries attend to the true whole-row
keys (what the gather delivers), and the ranks' outputs and gradients together must equal the
unsharded computation. tests/scripts/context_parallel_script.py runs the real thing over 2 and 4 gloo
processes, gather and reduce-scatter included, for every balancer.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    FAST,
    ROOT,
    SCRIPTS,
    assert_close_scaled,
    compose,
    final_params,
    read_metrics,
    run_train,
    train_losses,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from longctx import cp_balance
from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard, context_shard, gather_row
from longctx.cp_balance import (
    BALANCERS,
    EVEN_TOLERANCE,
    PlanStats,
    context_parallel_metrics,
    pairs,
    plan_stats,
    row_owner,
)
from longctx.distributed.layout import ParallelConfig
from longctx.model import Llama, LlamaConfig
from longctx.model.attention import attention, attention_over_row, build_attention_metadata
from longctx.model.attention.base import AttentionBackend
from longctx.model.attention.flash import context_key_spans
from longctx.model.attention.flex import build_context_block_mask
from longctx.model.attention.sdpa import lower_right_causal_attention
from longctx.train.app import run
from longctx.train.preflight import ConfigError, check_backend, check_parallel

H, HKV, D = 4, 2, 16
L = 96
# B = 3 rows: documents straddling chunk edges and one longer than L/N; a single document
# filling the row; documents all shorter than a chunk, then a pad tail (its own segment, no
# labels)
ROWS = [[5, 30, 1, 17, 40, 3], [96], [11, 12, 13, 14, 15, 16, 9]]
TAIL_PAD = 6  # the last row's remainder segment
# (balance, ranks, rounds) that split L = 96
SPLITS = [
    ("head_tail", 1, 1),
    ("head_tail", 2, 1),
    ("head_tail", 4, 1),
    ("rounds", 2, 2),
    ("documents", 1, 1),
    ("documents", 2, 1),
    ("documents", 3, 1),
    ("documents", 4, 1),
]


def make_batch(rows=ROWS, length=L, reset=False, seed=0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (len(rows), length), generator=gen)
    batch = PackedBatch.from_lengths(tokens, rows, reset_position_ids=reset)
    if sum(rows[-1]) < length:  # the remainder segment is a pad tail: no loss
        batch.labels[-1, sum(rows[-1]) :] = -100
    return batch


def make_qkv(b: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, H, D, generator=gen)
    k, v = (torch.randn(b, length, HKV, D, generator=gen) for _ in range(2))
    return q, k, v


def no_gather(x: torch.Tensor) -> torch.Tensor:
    """A simulated rank's all_gather: these tests hand attention the whole rows themselves."""
    raise AssertionError("a simulated context-parallel rank gathered")


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...] at the per-row positions index [B, n] -> [B, n, ...]."""
    return x.gather(1, index.view(*index.shape, *[1] * (x.ndim - 2)).expand(-1, -1, *x.shape[2:]))


# --------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("balance, size, rounds", SPLITS)
def test_shards_cover_every_row_token_once(balance, size, rounds):
    batch = make_batch()
    shards = [context_shard(batch, r, size, balance=balance, rounds=rounds) for r in range(size)]
    seen = torch.cat([s.global_index for s in shards], dim=1).sort(dim=1).values
    assert torch.equal(seen, torch.arange(L).expand(len(ROWS), L))
    for s in shards:
        assert s.shape == (len(ROWS), L // size)
        assert torch.equal(s.global_index, s.global_index.sort(dim=1).values)  # row order
        for name in ("tokens", "labels", "position_ids"):  # they travel with their tokens
            assert torch.equal(getattr(s, name), take(getattr(batch, name), s.global_index))
        assert s.row_len == L
    assert sum(s.num_loss_tokens for s in shards) == batch.num_loss_tokens
    assert shards[0].plan == shards[-1].plan  # every rank computes the whole plan


def test_head_tail_takes_chunks_r_and_2n_minus_1_minus_r():
    shard = context_shard(make_batch(), 1, 4, balance="head_tail")
    c = L // 8
    assert shard.global_index[0].tolist() == [*range(c, 2 * c), *range(6 * c, 7 * c)]


def test_pieces_record_the_keys_before_them_on_other_ranks():
    batch = make_batch(rows=[[5, 30, 61]], length=96)
    shard = context_shard(batch, 1, 2, balance="head_tail")  # chunks [24, 48) and [48, 72)
    # [24, 35) continues the document [5, 35); [35, 72) is one run of the document [35, 96)
    assert shard.seq_lens.tolist() == [[11, 37]]
    assert shard.key_prefix_lens.tolist() == [[19, 0]]


def test_rounds_interleave_head_tail_pairs_along_the_row():
    shard = context_shard(make_batch(), 0, 2, balance="rounds", rounds=3)  # 12 chunks of 8
    starts = shard.global_index[0, ::8].tolist()
    assert starts == [0, 24, 32, 56, 64, 88]  # chunks 0, 3 of each segment of 4 chunks


def test_documents_splits_a_long_document_over_every_rank_and_evens_out_the_rest():
    lengths = [10, 20, 30, 40, 50, 60, 70, 360]  # 640 tokens: 160 per rank
    owner = row_owner(np.array(lengths), 4, "documents")
    assert len(set(owner[-360:].tolist())) == 4  # 64980 of the 72120 pairs: all ranks share it
    stats = plan_stats([np.array(lengths)], [owner], 4)
    assert max(stats.work) <= min(stats.work) * (1 + EVEN_TOLERANCE)
    assert stats.pieces_per_rank <= 3
    assert sum(stats.work) == pairs(np.array(lengths)).sum()


@pytest.mark.parametrize("length", [32768, 131072])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_documents_meets_its_targets_on_the_benchmark_rows(length, size):
    """On benchmarks/bench_cp.py's rows (lognormal, median 600): every row's heaviest rank is
    within EVEN_TOLERANCE of its lightest, with at most 4 pieces per rank on average (the
    issue's targets: 1.05 mean and 1.15 worst, at most 4 pieces)."""
    sys.path.insert(0, str(BENCHMARKS))
    from bench_step import make_batch as bench_row

    stats = []
    for seed in range(16):
        lens = bench_row(length, seed=seed).seq_lens[0].numpy().astype(np.int64)
        stats.append(plan_stats([lens], [row_owner(lens, size, "documents")], size))
    assert max(max(s.work) / min(s.work) for s in stats) <= 1 + EVEN_TOLERANCE
    assert np.mean([s.pieces_per_rank for s in stats]) <= 4


@given(
    lengths=st.lists(st.integers(1, 400), min_size=1, max_size=40),
    size=st.sampled_from([1, 2, 3, 4, 8]),
)
@settings(max_examples=150, deadline=None)
def test_documents_plan_properties(lengths, size):
    """Every position once, exactly L/N per rank; evening out never lifts the heaviest rank
    or lowers the lightest (each trade moves less than the gap between the two it trades
    between)."""
    lengths[-1] += -sum(lengths) % size  # a row length the ranks divide
    lens = np.array(lengths)
    owner = row_owner(lens, size, "documents")
    assert owner.shape == (lens.sum(),) and owner.min() >= 0 and owner.max() < size
    assert np.bincount(owner, minlength=size).tolist() == [lens.sum() // size] * size
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cp_balance, "even_out", lambda *args: None)
        greedy = row_owner(lens, size, "documents")
    before, after = (plan_stats([lens], [o], size).work for o in (greedy, owner))
    assert max(after) <= max(before) and min(after) >= min(before)


@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    split=st.sampled_from(
        [
            (b, n, k)
            for b in BALANCERS
            for n in (1, 2, 3, 4)
            for k in (1, 2, 3)
            if b == "rounds" or k == 1
        ]
    ),  # fmt: skip
)
@settings(max_examples=60, deadline=None)
def test_dense_masks_of_all_shards_are_the_rows_mask(lengths, split):
    balance, size, rounds = split
    unit = size if balance == "documents" else 2 * size * rounds
    length = unit * (-(-sum(lengths) // unit))  # round up to a multiple the plan can split
    batch = make_batch(rows=[lengths], length=length)
    full = batch.to_dense_mask()
    covered = []
    for r in range(size):
        shard = context_shard(batch, r, size, balance=balance, rounds=rounds)
        assert torch.equal(shard.to_dense_mask(), take(full, shard.global_index))
        covered += shard.global_index[0].tolist()
    assert sorted(covered) == list(range(length))


def test_the_plan_is_a_function_of_the_row_alone():
    """The same row gives the same shard whatever the other rows of its batch, the rank that
    asks, the order of the calls, or the process: so a resumed run (on any number of ranks,
    elastic resume included) shards its rows exactly as the original run did."""
    batch = make_batch()
    alone = make_batch(rows=[ROWS[0]])
    alone.tokens[:] = batch.tokens[0]
    for balance, size, rounds in SPLITS:
        together = context_shard(batch, size - 1, size, balance=balance, rounds=rounds)
        single = context_shard(alone, size - 1, size, balance=balance, rounds=rounds)
        again = context_shard(batch, size - 1, size, balance=balance, rounds=rounds)
        assert torch.equal(together.global_index[0], single.global_index[0])
        assert torch.equal(together.tokens[0], single.tokens[0])
        assert torch.equal(together.global_index, again.global_index)


def test_plan_stats_count_pairs_and_pieces():
    lens = np.array([4, 4])  # rank 0: [0, 2) and [6, 8) of the row; rank 1: the rest
    owner = np.array([0, 0, 1, 1, 1, 1, 0, 0])
    stats = plan_stats([lens], [owner], 2)
    # rank 0: positions 0, 1 of document 0 (1 + 2) and 2, 3 of document 1 (3 + 4)
    assert stats.work == (10, 10) and stats.pieces == (2, 2)
    assert stats.work_imbalance == 1.0 and stats.pieces_per_rank == 2.0
    metrics = context_parallel_metrics([stats, PlanStats((30, 10), (1, 1), 1)])
    assert metrics == {"train/cp_work_imbalance": 1.25, "train/cp_pieces_per_rank": 1.5}
    assert context_parallel_metrics([]) == {}


def test_bad_splits_are_named():
    batch = make_batch()
    with pytest.raises(ValueError, match=r"L=96 .* multiple of 2\*size\*rounds=10"):
        context_shard(batch, 0, 5, balance="head_tail")
    with pytest.raises(ValueError, match=r"L=96 .* size 5: L must be a multiple of size=5"):
        context_shard(batch, 0, 5, balance="documents")
    with pytest.raises(ValueError, match=r"multiple of 2\*size\*rounds=20"):
        context_shard(batch, 0, 2, balance="rounds", rounds=5)
    with pytest.raises(ValueError, match=r"context_parallel_balance='documnets'; expected one of"):
        context_shard(batch, 0, 2, balance="documnets")
    with pytest.raises(ValueError, match=r"context_parallel_rounds=2 with .*'documents'"):
        context_shard(batch, 0, 2, balance="documents", rounds=2)
    with pytest.raises(ValueError, match="rank=2, size=2"):
        context_shard(batch, 2, 2)
    with pytest.raises(ValueError, match="size=0"):
        context_shard(batch, 0, 0)


def test_a_backend_without_per_rank_key_spans_refuses_documents():
    class ChunksOnly(AttentionBackend):
        name = "chunks_only"

    ChunksOnly().check_context_parallel("head_tail")
    with pytest.raises(ValueError, match="attn_backend='chunks_only' does not"):
        ChunksOnly().check_context_parallel("documents")


def test_a_shard_of_size_two_without_group_cannot_gather():
    shard = context_shard(make_batch(), 0, 2)
    with pytest.raises(ValueError, match="needs the process group"):
        build_attention_metadata(shard, "sdpa")


def test_shard_moves_with_its_metadata():
    shard = context_shard(make_batch(), 1, 2, no_gather)
    moved = shard.to("cpu")
    assert isinstance(moved, ContextShard)
    assert (moved.cp_rank, moved.cp_size, moved.all_gather, moved.plan) == (
        1, 2, no_gather, shard.plan,
    )  # fmt: skip
    assert torch.equal(moved.key_prefix_lens, shard.key_prefix_lens)


# --------------------------------------------------------------------------- attention
def simulated_ranks(backend, batch: PackedBatch, size: int, q, k, v, balance, rounds=1):
    """Every rank's output written back to its row positions: [B, L, H, D]."""
    out = torch.zeros_like(q)
    for r in range(size):
        shard = context_shard(batch, r, size, no_gather, balance=balance, rounds=rounds)
        meta = build_attention_metadata(shard, backend)
        idx = shard.global_index
        local = attention_over_row(take(q, idx), take(k, idx), take(v, idx), k, v, meta)
        out = out.scatter(1, idx[:, :, None, None].expand_as(local), local)
    return out


FLEX_ROWS = [[100, 300, 7, 600, 17], [1024], [37] * 27 + [25]]


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize(
    "balance, size, rounds", [s for s in SPLITS if s[1] != 3] + [("documents", 8, 1)]
)
def test_ranks_together_equal_unsharded_attention(backend, balance, size, rounds):
    length = 1024 if backend == "flex" else L  # flex: chunks of whole 128-token tiles
    rows = ROWS if backend != "flex" else FLEX_ROWS
    batch = make_batch(rows=rows, length=length)
    q, k, v = make_qkv(len(rows), length)
    with torch.no_grad():
        expected = attention(q, k, v, build_attention_metadata(batch, "eager"))
        got = simulated_ranks(backend, batch, size, q, k, v, balance, rounds)
    assert_close_scaled(got, expected)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "balance, size, rounds",
    [
        ("head_tail", 2, 1),
        ("head_tail", 3, 1),
        ("rounds", 2, 4),
        ("documents", 2, 1),
        ("documents", 3, 1),
        ("documents", 4, 1),
    ],  # fmt: skip
)
def test_ranks_together_give_the_unsharded_gradients(backend, balance, size, rounds):
    batch = make_batch()
    q, k, v = make_qkv(len(ROWS), L)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))

    def grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*leaves) * weight).sum().backward()
        return [t.grad for t in leaves]

    expected = grads(lambda q, k, v: attention(q, k, v, build_attention_metadata(batch, "eager")))
    got = grads(lambda q, k, v: simulated_ranks(backend, batch, size, q, k, v, balance, rounds))
    for g, e in zip(got, expected, strict=True):
        assert_close_scaled(g, e)


@pytest.mark.parametrize(
    "balance, size, rounds", [("head_tail", 2, 1), ("rounds", 3, 2), ("documents", 3, 1)]
)
def test_flash_key_spans_feed_a_varlen_kernel_exactly(balance, size, rounds):
    """The flash path's inputs (query cu_seqlens = the shard's, packed key spans, key
    cu_seqlens) run through a CPU stand-in of a bottom-right causal varlen kernel."""
    batch = make_batch()
    q, k, v = make_qkv(len(ROWS), L)
    with torch.no_grad():
        expected = attention(q, k, v, build_attention_metadata(batch, "eager"))
        for r in range(size):
            shard = context_shard(batch, r, size, no_gather, balance=balance, rounds=rounds)
            keys = context_key_spans(shard)
            q_flat = take(q, shard.global_index).flatten(0, 1)
            k_packed, v_packed = (x.flatten(0, 1)[keys["key_index"]] for x in (k, v))
            cu_q, cu_k = shard.cu_seqlens.tolist(), keys["cu_seqlens_k"].tolist()
            outs = [
                lower_right_causal_attention(
                    q_flat[cu_q[i] : cu_q[i + 1]],
                    k_packed[cu_k[i] : cu_k[i + 1]],
                    v_packed[cu_k[i] : cu_k[i + 1]],
                )
                for i in range(len(cu_q) - 1)
            ]
            got = torch.cat(outs).view(len(ROWS), -1, H, D)
            assert keys["max_seqlen_k"] == int(keys["cu_seqlens_k"].diff().max())
            assert_close_scaled(got, take(expected, shard.global_index))


@pytest.mark.parametrize("balance, size", [("head_tail", 2), ("documents", 2), ("documents", 8)])
def test_flex_block_mask_lists_exactly_the_tiles_with_visible_keys(balance, size):
    """Partial tiles hold some visible (query, key) pair and not all; full tiles all; every
    other tile none: the mask is as sparse as the plan allows."""
    batch = make_batch(rows=FLEX_ROWS, length=1024)
    for r in range(size):
        shard = context_shard(batch, r, size, no_gather, balance=balance)
        dense = shard.to_dense_mask().view(3, -1, 128, 8, 128).transpose(2, 3)
        any_visible, all_visible = dense.any((-1, -2)), dense.all((-1, -2))
        block_mask = build_context_block_mask(shard)
        full = block_lists_as_tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        partial = block_lists_as_tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
        assert torch.equal(full, all_visible)
        assert torch.equal(partial, any_visible & ~all_visible)


def block_lists_as_tiles(num_B1Q: torch.Tensor, idx_B1QK: torch.Tensor) -> torch.Tensor:
    b, _, n_q, n_kv = idx_B1QK.shape
    tiles = torch.zeros(b, n_q, n_kv, dtype=torch.bool)
    for bi in range(b):
        for qi in range(n_q):
            tiles[bi, qi, idx_B1QK[bi, 0, qi, : num_B1Q[bi, 0, qi]].long()] = True
    return tiles


def test_compiled_flex_does_not_recompile_for_a_new_document_layout():
    """Every tensor of a context shard's block mask (and of q, k, v) has a shape fixed by
    B, L/N, L and the heads; the layout changes values only. Dynamo guards on shapes, dtypes
    and the mask_mod's code, so rows of new layouts reuse the first graph: counted by a
    counting backend (dynamo's guards are the same under inductor, which compiles on CUDA)."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounter()
    compiled = torch.compile(flex_attention, backend=counter, dynamic=False)
    layouts = [FLEX_ROWS[:1], FLEX_ROWS[1:2], FLEX_ROWS[2:], [[500, 524]], [[3] * 300 + [124]]]
    q, k, v = (x.transpose(1, 2) for x in make_qkv(1, 1024))
    for balance, size in [("documents", 2), ("head_tail", 2), ("documents", 4)]:
        torch._dynamo.reset()
        counter.frame_count = 0
        for rows in layouts:
            for rank in range(size):
                batch = make_batch(rows=rows, length=1024)
                shard = context_shard(batch, rank, size, no_gather, balance=balance)
                block_mask = build_attention_metadata(shard, "flex").data
                local = q.gather(2, shard.global_index[:, None, :, None].expand(-1, H, -1, D))
                with torch.no_grad():
                    compiled(local, k, v, block_mask=block_mask, enable_gqa=True)
        assert counter.frame_count == 1, (balance, size)


def test_lower_right_causal_attention_in_many_blocks(monkeypatch):
    import longctx.model.attention.sdpa as cp

    q, k, v = make_qkv(1, 40)
    q, k, v = q[0, 25:], k[0], v[0]  # 15 queries, the last of 40 keys
    weight = torch.randn(15, H, D)

    def value_and_grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = lower_right_causal_attention(*leaves)
        (out * weight).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    one_call = value_and_grads()
    monkeypatch.setattr(cp, "MASK_BLOCK_ELEMENTS", 40 * 4)  # blocks of 4 queries, checkpointed
    for got, expected in zip(value_and_grads(), one_call, strict=True):
        assert_close_scaled(got, expected)
    mask = torch.ones(15, 40, dtype=torch.bool).tril(25)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1).repeat_interleave(2, 0),
        v.transpose(0, 1).repeat_interleave(2, 0),
        attn_mask=mask,
    ).transpose(0, 1)
    assert_close_scaled(one_call[0], ref)


@pytest.mark.parametrize("balance, rounds", [("head_tail", 1), ("rounds", 3), ("documents", 1)])
def test_gather_row_of_one_rank_puts_the_tokens_back_in_row_order(balance, rounds):
    batch = make_batch()
    shard = context_shard(batch, 0, 1, balance=balance, rounds=rounds)
    assert torch.equal(gather_row(shard.tokens, shard), batch.tokens)
    shards = [context_shard(batch, r, 4, balance="documents") for r in range(4)]
    gathered = torch.stack([s.tokens for s in shards])  # what the all-gather delivers
    row = gathered.flatten(0, 2)[shards[2].gather_index].view(batch.shape)
    assert torch.equal(row, batch.tokens)


# --------------------------------------------------------------------------- the planner
BENCHMARKS = ROOT / "benchmarks"


@pytest.mark.parametrize("size", [2, 8])
@pytest.mark.parametrize("balance, rounds", [("head_tail", 1), ("rounds", 16), ("documents", 1)])
def test_planner_expects_the_imbalance_measured_on_the_benchmark_rows(size, balance, rounds):
    """The planner's expected max/mean work for lognormal(600, 1) documents (its own sampled
    rows) is within 10% of the mean over benchmarks/bench_cp.py's 16 rows at 32k."""
    from longctx import planner
    from longctx.planner.cp_simulation import expected_cp_work_imbalance
    from longctx.planner.layout import LENGTH_SAMPLE_ROWS

    sys.path.insert(0, str(BENCHMARKS))
    from bench_step import make_batch as bench_row

    measured = []
    for seed in range(16):
        lens = bench_row(32768, seed=seed).seq_lens[0]
        lens = lens[lens > 0].numpy().astype(np.int64)
        stats = plan_stats([lens], [row_owner(lens, size, balance, rounds)], size)
        measured.append(stats.work_imbalance)
    layout = planner.RunLayout(
        seq_len=32768,
        devices=size,
        context_parallel=size,
        context_parallel_balance=balance,
        context_parallel_rounds=rounds,
        doc_length_lognormal=(600.0, 1.0),
    )
    expected = expected_cp_work_imbalance(layout)
    assert expected.mean == pytest.approx(np.mean(measured), rel=0.10)
    assert expected.rows == LENGTH_SAMPLE_ROWS


def test_planner_step_time_waits_for_the_slowest_rank():
    from longctx import planner

    layout = planner.RunLayout(
        seq_len=32768, devices=8, context_parallel=8, doc_length_lognormal=(600.0, 1.0)
    )
    h100 = planner.known_device("H100")
    steps = {
        b: planner.plan(TINY_PLAN, dataclasses.replace(layout, context_parallel_balance=b), h100)
        for b in ("head_tail", "documents")
    }
    head_tail, documents = steps["head_tail"].step, steps["documents"].step
    assert head_tail.cp_work_imbalance > 1.5 > 1.05 > documents.cp_work_imbalance
    assert head_tail.flops_per_rank > documents.flops_per_rank
    assert "context parallel balance=documents: expected attention work imbalance" in (
        planner.format_plan(steps["documents"])
    )
    with pytest.raises(planner.PlanError, match="context_parallel_balance='tail'"):
        dataclasses.replace(layout, context_parallel_balance="tail")
    with pytest.raises(planner.PlanError, match="doc_length_lognormal"):
        dataclasses.replace(layout, doc_length_lognormal=(0.0, 1.0))


TINY_PLAN = LlamaConfig.from_name("tiny")


# --------------------------------------------------------------------------- models over gloo
SCRIPT = SCRIPTS / "context_parallel_script.py"


@pytest.mark.parametrize(
    "world, context_parallel, balance, rounds",
    [
        (2, 2, "head_tail", 1),
        (2, 2, "rounds", 3),
        (2, 2, "documents", 1),
        (4, 4, "documents", 1),
        (4, 2, "rounds", 2),
    ],
)
def test_model_over_gloo_ranks_equals_one_rank(world, context_parallel, balance, rounds):
    """Logits, loss and every parameter gradient of W gloo ranks equal one process (1e-5),
    for both position modes; (4, 2, ...) is a 2 x 2 mesh: two data-parallel replicas, each row
    split over two ranks."""
    args = [str(world), str(context_parallel), balance, str(rounds)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compared" in proc.stdout


def tiny_config(**overrides) -> LlamaConfig:
    fields = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    return LlamaConfig(**(fields | {"max_seq_len": 256, "attn_backend": "sdpa"} | overrides))


def test_model_with_one_rank_shard_equals_the_batch():
    """N=1 runs the context-parallel code path (two chunks, spliced pieces) without a group."""
    torch.manual_seed(0)
    model = Llama(tiny_config())
    batch = make_batch(reset=True)
    shard = context_shard(batch, 0, 1, balance="head_tail")
    assert_close_scaled(model(shard), model(batch))
    loss, n = model.loss(shard)
    expected_loss, expected_n = model.loss(batch)
    assert n == expected_n
    assert_close_scaled(loss, expected_loss)


# --------------------------------------------------------------------------- train.py
CP_RUN = [
    *FAST,
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=3",
    "callbacks.checkpoint.save_top_k=-1",
]
CP2 = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "parallel.context_parallel=2"]


def assert_same_training(run_dir: Path, reference: Path, first_step: int = 0) -> None:
    """Same train and validation losses and parameters as the reference run (from first_step
    on), to fp32 noise; parameters only from single-file checkpoints (FSDP2 writes folders)."""
    assert train_losses(run_dir) == pytest.approx(train_losses(reference)[first_step:], rel=1e-5)
    val = [val_losses(d) for d in (run_dir, reference)]
    assert val[0] == pytest.approx(val[1][len(val[1]) - len(val[0]) :], rel=1e-5)
    if (run_dir / "checkpoints" / "last.ckpt").is_dir():
        return
    got, expected = final_params(run_dir), final_params(reference)
    for name, value in expected.items():
        # AdamW moves a weight by up to lr (6e-4 here) per step whatever its gradient's size, so
        # reduction-order noise in a near-zero gradient shows at the scale of lr, not of the
        # weight: the bound is 2% of one step's update
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)


def val_losses(run_dir: Path) -> list[float]:
    return [float(r["val/loss"]) for r in read_metrics(run_dir) if r.get("val/loss")]


def step3_checkpoint(run_dir: Path, tmp_path: Path) -> Path:
    mid = tmp_path / f"{run_dir.name}_step3.ckpt"  # a plain name: Hydra would need '=' quoted
    next((run_dir / "checkpoints").glob("*step=3.ckpt")).rename(mid)
    return mid


@pytest.mark.slow
def test_context_parallel_training_equals_one_rank_and_resumes_across_sizes(tmp_path):
    """6 AdamW steps: 2 ranks splitting every row (no data parallelism) == 1 process; a
    checkpoint of either resumes on the other size and lands on the same parameters."""
    runs = tmp_path / "outputs" / "train"
    run_train([*CP_RUN, "run_name=cp1"], tmp_path)
    run_train([*CP_RUN, *CP2, "run_name=cp2"], tmp_path)
    assert_same_training(runs / "cp2", runs / "cp1")
    cp1_mid, cp2_mid = (
        step3_checkpoint(runs / "cp1", tmp_path),
        step3_checkpoint(runs / "cp2", tmp_path),
    )
    cp2_metrics = [r for r in read_metrics(runs / "cp2") if r.get("train/cp_work_imbalance")]
    assert len(cp2_metrics) == 6  # one per step, from the default balancer's plans
    assert all(1 <= float(r["train/cp_work_imbalance"]) < 2 for r in cp2_metrics)
    assert all(float(r["train/cp_pieces_per_rank"]) >= 0 for r in cp2_metrics)
    assert not any(r.get("train/cp_work_imbalance") for r in read_metrics(runs / "cp1"))
    # another balancer on resume: the plan is the row's alone, and the math the same
    rounds = ["parallel.context_parallel_balance=rounds", "parallel.context_parallel_rounds=4"]
    run_train([*CP_RUN, *CP2, *rounds, "run_name=up", f"ckpt_path={cp1_mid}"], tmp_path)
    run_train([*CP_RUN, "run_name=down", f"ckpt_path={cp2_mid}"], tmp_path)
    assert_same_training(runs / "up", runs / "cp1", first_step=3)
    assert_same_training(runs / "down", runs / "cp1", first_step=3)


@pytest.mark.slow
def test_context_parallel_under_fsdp2_trains_like_one_process(tmp_path):
    runs = tmp_path / "outputs" / "train"
    run_train([*CP_RUN, "run_name=cp1"], tmp_path)
    fsdp = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
    run_train([*CP_RUN, *fsdp, "parallel.context_parallel=2", "run_name=fsdp_cp2"], tmp_path)
    assert_same_training(runs / "fsdp_cp2", runs / "cp1")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.context_parallel=2"], "context_parallel=2 must divide the world size 1"),
        ([*CP2, "parallel.context_parallel=3"], "context_parallel=3 must divide the world size 2"),
        (
            [*CP2, "data.seq_len=251"],
            "L=251 tokens cannot be split over context parallel size 2: L must be a multiple of "
            "size=2",
        ),
        (
            [*CP2, "data.seq_len=250", "parallel.context_parallel_balance=head_tail"],
            "L=250 tokens cannot be split over context parallel size 2 in 1 round(s): L must be "
            "a multiple of 2*size*rounds=4",
        ),
        (["parallel.context_parallel=0"], "parallel.context_parallel=0; expected an integer >= 1"),
        (
            [
                *CP2,
                "parallel.context_parallel_balance=rounds",
                "parallel.context_parallel_rounds=3",
            ],
            "parallel.context_parallel_rounds=3: a row of L=256 tokens cannot be split over "
            "context parallel size 2 in 3 round(s): L must be a multiple of 2*size*rounds=12",
        ),
        (
            [*CP2, "parallel.context_parallel_balance=document"],
            "context_parallel_balance='document'; expected one of ('head_tail', 'rounds', "
            "'documents')",
        ),
        (
            [*CP2, "parallel.context_parallel_rounds=2"],
            "context_parallel_rounds=2 with context_parallel_balance='documents': rounds apply "
            "to the 'rounds' balancer only",
        ),
    ],
)
def test_bad_context_parallel_config_stops_before_training(overrides, message, tmp_path):
    cfg = compose([*FAST, *overrides], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists()


HF_LIKE_SPEC = types.SimpleNamespace(supports_context_parallel=False)


def test_context_parallel_refuses_models_and_flex_shapes_it_cannot_split():
    trainer = OmegaConf.create({"devices": 4, "num_nodes": 1})
    with pytest.raises(ConfigError, match="only longctx's Llama"):
        check_parallel(trainer, HF_LIKE_SPEC, 256, ParallelConfig(context_parallel=2))
    flex = tiny_config(attn_backend="flex", max_seq_len=512)
    cuda = torch.device("cuda")  # nothing runs on it
    with pytest.raises(ConfigError, match=r"L=256 to be a multiple of 4 chunk\(s\) x 128 = 512"):
        check_backend(flex, 256, cuda, context_chunks=4)
    check_backend(flex, 512, cuda, context_chunks=4)  # whole blocks: fine


@pytest.mark.slow
def test_the_benchmark_quick_mode_runs_every_balancer(tmp_path):
    """benchmarks/bench_cp.py --quick: every balancer in every table (no timing asserted)."""
    out = tmp_path / "cp.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_cp.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    names = {"head_tail", "rounds16", "rounds64", "documents"}
    for table in ("balance", "gloo_attention", "simulated_attention"):
        assert all(names <= set(row) for row in report[table]), table
    assert [row["ranks"] for row in report["balance"]] == [2, 4, 8]
    assert {s["balance"] for s in report["steps"]} == {"one process", "head_tail", "documents"}
    assert "work imbalance" in proc.stdout
