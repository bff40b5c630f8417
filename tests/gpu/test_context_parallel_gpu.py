"""CUDA: the context-parallel attention paths of every backend against the eager reference.

Run by scripts/gpu_check.sh on a single GPU: every rank of a group is simulated in one process
(its queries against the true whole-row keys, what the all-gather delivers), which exercises the
flash path's separate query/key cu_seqlens with bottom-right causal alignment and flex's local
query tiles. Imports only torch, pytest and longctx's batch and attention modules.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.batch import PackedBatch
from longctx.distributed.context_parallel import context_shard
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


def simulated_ranks(backend, impl, batch, size, rounds, q, k, v):
    """Every rank's output written back to its row positions: [B, L, H, D]."""
    out = torch.zeros_like(q)
    for r in range(size):
        shard = context_shard(batch, r, size, group="simulated", rounds=rounds)
        meta = build_attention_metadata(shard, backend)
        if impl is not None:
            meta = dataclasses.replace(meta, data=dataclasses.replace(meta.data, impl=impl))
        idx = shard.global_index
        out = out.index_copy(
            1, idx, attention_over_row(q[:, idx], k[:, idx], v[:, idx], k, v, meta)
        )
    return out


def outputs_and_grads(fn, q, k, v, weight):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    (out.float() * weight).sum().backward()
    return [out.detach().float()] + [t.grad.float() for t in leaves]


# flash takes bf16 only (its fp32 refusal is tested in test_attention_gpu.py); flex compiles
# once per shape and dtype (20-60 s each), so it runs the 2-rank shape only
CASES = [
    (backend, impl, dtype, size, rounds)
    for backend, impl in VARIANTS
    for dtype in ([torch.bfloat16] if backend == "flash" else [torch.float32, torch.bfloat16])
    for size, rounds in ([(2, 2)] if backend == "flex" else [(1, 1), (2, 2)])
]


@pytest.mark.parametrize("backend, impl, dtype, size, rounds", CASES)
def test_context_parallel_ranks_equal_unsharded(backend, impl, dtype, size, rounds):
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
        lambda q, k, v: simulated_ranks(backend, impl, batch, size, rounds, q, k, v),
        q,
        k,
        v,
        weight,
    )
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True):
        scale = e.abs().max().clamp(min=1)
        torch.testing.assert_close(g / scale, e / scale, atol=TOL[dtype], rtol=0, msg=name)
