"""CUDA tests of the attention backends against the eager dense-mask reference.

Run by scripts/gpu_check.sh on a GPU machine (no Hydra or W&B needed: this module imports only
torch, pytest and longctx's batch and attention modules). fp32 runs every backend but flash
(which refuses fp32, checked too); bf16 runs all of them with a bf16 tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longctx.batch import PackedBatch
from longctx.model.attention import (
    AttentionMetadata,
    attention,
    build_attention_metadata,
    resolve_backend,
)
from longctx.model.attention.flash import available_flash_impls, flash_attn_importable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

H, HKV = 8, 2
LENGTH = 1000  # not a multiple of the flex block size (128)
# row 0: odd lengths and a pad tail; row 1: many tiny documents; row 2: one long document
LAYOUT = [[7, 130, 1, 257, 300, 5], [3] * 200 + [17, 250, 133], [LENGTH]]
# (name, flash implementation or None): every way this machine can run attention
VARIANTS = [
    ("flash/flash_attn", "flash_attn"),
    ("flash/torch_varlen", "torch_varlen"),
    ("flex", None),
    ("sdpa", None),
]
TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}


def cuda_batch(layout=LAYOUT, length=LENGTH) -> PackedBatch:
    tokens = torch.zeros(len(layout), length, dtype=torch.long)
    return PackedBatch.from_lengths(tokens, layout, reset_position_ids=True).to("cuda")


def make_qkv(batch_size: int, head_dim: int, dtype, length=LENGTH):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(batch_size, length, n, head_dim) for n in (H, HKV, HKV)]
    return [torch.randn(s, generator=gen, device="cuda").to(dtype) for s in shapes]


def variant_metadata(name: str, impl: str | None, batch: PackedBatch) -> AttentionMetadata:
    backend = name.split("/")[0]
    if impl is not None and impl not in available_flash_impls(torch.device("cuda")):
        pytest.skip(f"flash implementation {impl!r} is not available on this machine")
    meta = build_attention_metadata(batch, backend)
    if impl is None:
        return meta
    return dataclasses.replace(meta, data=dataclasses.replace(meta.data, impl=impl))


def forward_and_grads(meta, q, k, v, grad_out):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, meta)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Max abs error within tol, scaled by the reference's magnitude when it exceeds 1."""
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol} * {scale:.3g}"


# (head_dim, dtype) cases; few, since each is a separate flex compilation (~20-40 s)
CASES = [(128, torch.float32), (64, torch.bfloat16), (128, torch.bfloat16)]


@pytest.mark.parametrize("head_dim, dtype", CASES, ids=["d128-fp32", "d64-bf16", "d128-bf16"])
@pytest.mark.parametrize("name, impl", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_backend_matches_eager_forward_and_backward(name, impl, head_dim, dtype):
    batch = cuda_batch()
    meta = variant_metadata(name, impl, batch)
    q, k, v = make_qkv(len(LAYOUT), head_dim, dtype)
    grad_out = torch.randn_like(q)
    if name.startswith("flash") and dtype == torch.float32:
        with pytest.raises(ValueError, match="does not support dtype torch.float32"):
            attention(q, k, v, meta)
        return
    got = forward_and_grads(meta, q, k, v, grad_out)
    # reference: fp32 inputs (the bf16 values, upcast) through the eager dense mask
    ref_meta = build_attention_metadata(batch, "eager")
    want = forward_and_grads(ref_meta, q.float(), k.float(), v.float(), grad_out.float())
    assert got[0].dtype == dtype
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(f"{name} {label}", g, w, TOL[dtype])


def test_auto_picks_flash_or_flex_on_cuda():
    want = "flash" if flash_attn_importable() else "flex"
    assert resolve_backend("auto", torch.device("cuda")) == want


def test_compiled_flex_does_not_recompile_for_a_new_layout():
    """A new batch layout (same shape) gives a new BlockMask and mask_mod closure; the compiled
    flex kernel must be reused, not recompiled (recompiles would cost seconds every step)."""
    from torch._dynamo.utils import counters

    q, k, v = make_qkv(3, 128, torch.bfloat16)  # a shape the parity test compiled already
    layouts = (LAYOUT, [[100, 900]] * 3, [[1, 2, 3, 994], [LENGTH], [500, 250, 250]])
    attention(q, k, v, build_attention_metadata(cuda_batch(layouts[0]), "flex"))
    graphs_before = counters["stats"]["unique_graphs"]
    for layout in layouts[1:]:
        attention(q, k, v, build_attention_metadata(cuda_batch(layout), "flex"))
    assert counters["stats"]["unique_graphs"] == graphs_before


def test_sdpa_plan_and_metadata_live_on_the_gpu():
    meta = build_attention_metadata(cuda_batch(), "sdpa")
    plan = meta.data.plan
    for idx in (plan.slot_token_idx, plan.real_slot_idx):
        assert idx is None or idx.is_cuda
    flex_meta = build_attention_metadata(cuda_batch(), "flex")
    assert flex_meta.data.kv_num_blocks.is_cuda
