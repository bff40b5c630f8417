"""CUDA: the context-parallel attention paths of every backend against the eager reference.

Run by scripts/gpu_check.sh on a single GPU: every rank of a group is simulated in one process
(its queries against the true whole-row keys, what the all-gather delivers), which exercises the
flash path's separate query/key cu_seqlens with bottom-right causal alignment and flex's local
query tiles, for every balancer; and compiled flex (inductor) must not recompile for a new
document layout. Imports only torch, pytest and longctx's batch and attention modules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.batch import PackedBatch
from longctx.context_shard import context_shard
from longctx.model.attention import attention, attention_over_row, build_attention_metadata
from longctx.model.attention.flash import available_flash_impls

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

H, HKV, D = 8, 2, 64
LENGTH = 1024  # chunks of 128 tokens (whole flex blocks) with 2 ranks x 2 rounds
LAYOUT = [[100, 300, 7, 600, 17], [LENGTH], [37] * 27 + [25]]
VARIANTS = [("flash", "flash_attn"), ("flash", "torch_varlen"), ("flex", None), ("sdpa", None)]
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def no_gather(x: torch.Tensor) -> torch.Tensor:
    """A simulated rank's all_gather: these tests hand attention the whole rows themselves."""
    raise AssertionError("a simulated context-parallel rank gathered")


def simulated_ranks(backend, impl, batch, size, balance, rounds, q, k, v):
    """Every rank's output written back to its row positions: [B, L, H, D]."""
    out = torch.zeros_like(q)
    for r in range(size):
        shard = context_shard(batch, r, size, no_gather, balance=balance, rounds=rounds)
        meta = build_attention_metadata(shard, backend)
        if impl is not None:
            meta = dataclasses.replace(meta, data=dataclasses.replace(meta.data, impl=impl))
        idx = shard.global_index  # [B, L/N] row positions
        local = attention_over_row(take(q, idx), take(k, idx), take(v, idx), k, v, meta)
        out = out.scatter(1, idx[:, :, None, None].expand_as(local), local)
    return out


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, L, n, D] at the per-row positions index [B, m] -> [B, m, n, D]."""
    return x.gather(1, index[:, :, None, None].expand(-1, -1, *x.shape[2:]))


def outputs_and_grads(fn, q, k, v, weight):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    (out.float() * weight).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


# flash takes bf16 only (its fp32 refusal is tested in test_attention_gpu.py); flex compiles
# once per shape and dtype (20-60 s each), so it runs the 2-rank shapes only
CASES = [
    (backend, impl, dtype, size, balance, rounds)
    for backend, impl in VARIANTS
    for dtype in ([torch.bfloat16] if backend == "flash" else [torch.float32, torch.bfloat16])
    for size, balance, rounds in (
        [(2, "rounds", 2), (2, "documents", 1)]
        if backend == "flex"
        else [(1, "head_tail", 1), (2, "rounds", 2), (2, "documents", 1), (4, "documents", 1)]
    )
]


@pytest.mark.parametrize("backend, impl, dtype, size, balance, rounds", CASES)
def test_context_parallel_ranks_equal_unsharded(backend, impl, dtype, size, balance, rounds):
    device = torch.device("cuda")
    if impl is not None and impl not in available_flash_impls(device):
        pytest.skip(f"flash implementation {impl} not available here")
    tokens = torch.zeros(len(LAYOUT), LENGTH, dtype=torch.long)
    batch = PackedBatch.from_lengths(tokens, LAYOUT, reset_position_ids=False).to(device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(len(LAYOUT), LENGTH, n, D, generator=gen, device=device, dtype=dtype)
        for n in (H, HKV, HKV)
    )
    weight = torch.randn(q.shape, generator=gen, device=device)
    meta = build_attention_metadata(batch, "eager")
    expected = outputs_and_grads(
        lambda q, k, v: attention(q.float(), k.float(), v.float(), meta), q, k, v, weight
    )
    got = outputs_and_grads(
        lambda q, k, v: simulated_ranks(backend, impl, batch, size, balance, rounds, q, k, v),
        q,
        k,
        v,
        weight,
    )
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        scale = e.abs().max().clamp(min=1)
        torch.testing.assert_close(g / scale, e / scale, atol=TOL[dtype], rtol=0, msg=name)


def test_compiled_flex_does_not_recompile_for_a_new_document_layout():
    """The real compiled path (inductor, forward and backward): shards of rows with other
    document layouts reuse the first compilation; only shapes (B, L/N, L, heads, dtype)
    recompile."""
    from torch._dynamo.utils import counters

    from longctx.model.attention.flex import flex_document_attention

    device = torch.device("cuda")
    layouts = [LAYOUT[:1], LAYOUT[1:2], LAYOUT[2:], [[500, 524]], [[3] * 300 + [124]]]
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k, v = (
        torch.randn(1, LENGTH, HKV, D, generator=gen, device=device, requires_grad=True)
        for _ in range(2)
    )
    for rows in layouts:
        batch = PackedBatch.from_lengths(
            torch.zeros(1, LENGTH, dtype=torch.long), rows, reset_position_ids=False
        ).to(device)
        shard = context_shard(batch, 1, 2, no_gather, balance="documents")
        q = torch.randn(1, LENGTH // 2, H, D, generator=gen, device=device, requires_grad=True)
        block_mask = build_attention_metadata(shard, "flex").data
        flex_document_attention(q, k, v, block_mask).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
