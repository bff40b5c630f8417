"""CPU tests of the attention backends against a per-document reference (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_scaled
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from longctx.batch import DENSE_MASK_MAX_LEN, PackedBatch
from longctx.model.attention import (
    AttentionMetadata,
    attention,
    backends,
    build_attention_metadata,
    get_backend,
    resolve_backend,
)
from longctx.model.attention.flex import build_document_block_mask
from longctx.model.attention.names import ATTENTION_BACKENDS
from longctx.model.attention.sdpa import (
    PAD_BUDGET_TOKENS2,
    build_sdpa_plan,
    group_documents,
    sdpa_attention,
)

CPU_BACKENDS = ("sdpa", "eager", "flex")
TRAINING_CPU_BACKENDS = ("sdpa", "eager")
H, HKV, D = 4, 2, 16
L = 200
# row 0: odd lengths and a pad tail; row 1: many tiny documents; row 2: one long document
MIXED_LENGTHS = [[7, 13, 1, 29, 51, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9] * 4 + [20], [L]]


def make_batch(lengths: list[list[int]], length: int = L) -> PackedBatch:
    tokens = torch.zeros(len(lengths), length, dtype=torch.long)
    return PackedBatch.from_lengths(tokens, lengths, reset_position_ids=True)


def make_qkv(batch_size: int, length: int = L, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch_size, length, H, D, generator=gen, dtype=dtype)
    k = torch.randn(batch_size, length, HKV, D, generator=gen, dtype=dtype)
    v = torch.randn(batch_size, length, HKV, D, generator=gen, dtype=dtype)
    return q, k, v


def per_document_reference(q, k, v, seq_lens: torch.Tensor) -> torch.Tensor:
    """Plain causal SDPA on each document's slice on its own, k/v heads repeated for GQA."""
    n_rep = q.shape[2] // k.shape[2]
    rows = []
    for b, row in enumerate(seq_lens.tolist()):
        outs, start = [], 0
        for n in (n for n in row if n > 0):
            q_HnD = q[b, start : start + n].transpose(0, 1)
            k_HnD = k[b, start : start + n].repeat_interleave(n_rep, dim=1).transpose(0, 1)
            v_HnD = v[b, start : start + n].repeat_interleave(n_rep, dim=1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(q_HnD, k_HnD, v_HnD, is_causal=True))
            start += n
        rows.append(torch.cat(outs, dim=1).transpose(0, 1))
    return torch.stack(rows)


def run_backend(backend: str, batch: PackedBatch, q, k, v) -> torch.Tensor:
    meta = build_attention_metadata(batch, backend)
    if backend == "flex":  # CPU flex is forward-only
        with torch.no_grad():
            return attention(q, k, v, meta)
    return attention(q, k, v, meta)


def grads_of(fn, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    (fn(q, k, v) * weight).sum().backward()
    return q.grad, k.grad, v.grad


# ------------------------------------------------------------------------ forward parity
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_matches_per_document_reference(backend):
    batch = make_batch(MIXED_LENGTHS)
    q, k, v = make_qkv(3)
    out = run_backend(backend, batch, q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = per_document_reference(q, k, v, batch.seq_lens)
    assert_close_scaled(out, expected)


@pytest.mark.parametrize("backend", ("sdpa", "flex"))
def test_forward_matches_eager(backend):
    batch = make_batch(MIXED_LENGTHS)
    q, k, v = make_qkv(3, seed=1)
    eager = run_backend("eager", batch, q, k, v)
    assert_close_scaled(run_backend(backend, batch, q, k, v), eager)


@pytest.mark.parametrize("backend", TRAINING_CPU_BACKENDS)
def test_gradients_match_per_document_reference(backend):
    batch = make_batch(MIXED_LENGTHS)
    q, k, v = make_qkv(3, seed=2)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    meta = build_attention_metadata(batch, backend)
    got = grads_of(lambda q, k, v: attention(q, k, v, meta), q, k, v, weight)
    want = grads_of(
        lambda q, k, v: per_document_reference(q, k, v, batch.seq_lens), q, k, v, weight
    )
    for name, g, w in zip("qkv", got, want, strict=True):
        assert_close_scaled(g, w, msg=f"d{name} differs")


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=12), min_size=1, max_size=3),
    budget=st.sampled_from([0, 64, 128**2, 10**9]),
)
def test_sdpa_matches_reference_for_any_layout(rows, budget):
    """Any segment layout (pad tails included) and any bucketing budget gives the reference."""
    length = max(sum(r) for r in rows) + 3
    batch = make_batch(rows, length)
    q, k, v = make_qkv(len(rows), length)
    out = sdpa_attention(q, k, v, build_sdpa_plan(batch, pad_budget=budget))
    assert_close_scaled(out, per_document_reference(q, k, v, batch.seq_lens))


def test_sdpa_padding_that_makes_slots_outnumber_tokens():
    """Segments [4, 3] bucketed together: 8 slots for 7 tokens (found by hypothesis)."""
    batch = make_batch([[4]], 7)
    plan = build_sdpa_plan(batch, pad_budget=64)
    assert plan.bucket_shapes == ((2, 4),) and plan.padded_shapes == ((2, 4),)
    q, k, v = make_qkv(1, 7)
    out = sdpa_attention(q, k, v, plan)
    assert_close_scaled(out, per_document_reference(q, k, v, batch.seq_lens))


def test_sdpa_bf16_close_to_fp32_eager():
    batch = make_batch(MIXED_LENGTHS)
    q, k, v = make_qkv(3, seed=4)
    eager = run_backend("eager", batch, q, k, v)
    out = run_backend("sdpa", batch, q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16
    assert (out.float() - eager).abs().max() <= 2e-2


# ------------------------------------------------------------------- masking semantics
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_segment_per_row_is_plain_causal_attention(backend):
    q, k, v = make_qkv(2)
    plain_BHLD = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    whole = run_backend(backend, make_batch([[L], [L]]), q, k, v)
    assert_close_scaled(whole, plain_BHLD.transpose(1, 2))
    masked = run_backend(backend, make_batch([[60, L - 60], [L]]), q, k, v)
    assert_close_scaled(masked[1], whole[1])  # row 1 is one segment in both
    assert_close_scaled(masked[0, :60], whole[0, :60])  # before the boundary: same
    assert (masked[0, 60:] - whole[0, 60:]).abs().amax(dim=(1, 2)).min() > 1e-3  # after: not


def test_changing_another_document_does_not_change_outputs():
    """Perturbing document 2's keys/values leaves documents 1 and 3 bit-for-bit unaffected."""
    batch = make_batch([[50, 70, 80]])
    q, k, v = make_qkv(1)
    k2, v2 = k.clone(), v.clone()
    k2[0, 50:120] += 1.0
    v2[0, 50:120] -= 1.0
    meta = build_attention_metadata(batch, "sdpa")
    before, after = attention(q, k, v, meta), attention(q, k2, v2, meta)
    assert torch.equal(before[0, :50], after[0, :50])
    assert torch.equal(before[0, 120:], after[0, 120:])
    assert not torch.allclose(before[0, 50:120], after[0, 50:120])


# ---------------------------------------------------------------------- sdpa bucketing
def test_group_documents_covers_each_document_once_longest_first():
    lengths = [600, 3, 610, 1, 2000, 90, 605, 17]
    budget = 128 * 128
    groups = group_documents(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        lead = lengths[g[0]]
        assert all(lead >= lengths[i] for i in g)
        assert all(lead**2 - lengths[i] ** 2 <= budget for i in g)
    assert [[lengths[i] for i in g] for g in groups] == [[2000], [610, 605, 600], [90, 17, 3, 1]]


def test_many_tiny_documents_take_few_sdpa_calls():
    lengths = [[(i % 30) + 1 for i in range(600)]]  # each of 1..30, 20 times
    batch = make_batch(lengths, sum(lengths[0]))
    assert PAD_BUDGET_TOKENS2["cpu"] >= 30**2
    plan = build_sdpa_plan(batch)
    assert plan.bucket_shapes == ((600, 30),)
    assert build_sdpa_plan(batch, pad_budget=0).bucket_shapes == tuple(
        (20, n) for n in range(30, 0, -1)
    )


def test_long_documents_run_in_place_and_tiny_ones_in_padded_stretches():
    batch = make_batch([[300, 5, 7, 6, 200, 3]], 521)
    plan = build_sdpa_plan(batch, pad_budget=32 * 32)
    assert plan.run_sizes == (300, 18, 200, 3)
    assert plan.direct == ((0, 1, 300), (2, 1, 200))
    assert plan.padded_runs == (1, 3) and plan.padded_shapes == ((4, 7),)
    q, k, v = make_qkv(1, 521)
    out = sdpa_attention(q, k, v, plan)
    assert_close_scaled(out, per_document_reference(q, k, v, batch.seq_lens))


def test_negative_pad_budget_is_an_error():
    with pytest.raises(ValueError, match="pad_budget=-1"):
        build_sdpa_plan(make_batch([[L]]), pad_budget=-1)


def test_equal_contiguous_documents_need_no_gather():
    plan = build_sdpa_plan(make_batch([[L], [L]]))
    assert plan.bucket_shapes == ((2, L),) and plan.run_sizes == (2 * L,)
    assert plan.slot_token_idx is None and plan.padded_shapes == ()


# -------------------------------------------------------------------- flex block mask
@pytest.mark.parametrize(
    "lengths, length",
    [([[300]], 300), ([[3, 5, 200, 92], [300]], 300), ([[128, 128, 1], [1] * 257], 257)],
)
def test_flex_block_mask_equals_create_block_mask(lengths, length):
    batch = make_batch(lengths, length)
    doc_ids = batch.doc_ids

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    want = create_block_mask(mask_mod, len(lengths), None, length, length, device="cpu")
    got = build_document_block_mask(batch)
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    assert torch.equal(got.to_dense(), want.to_dense())


# ------------------------------------------------------------------------- resolution
def test_auto_resolves_to_sdpa_on_cpu():
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"
    for name in ("sdpa", "eager", "flex"):
        assert resolve_backend(name, "cpu") == name


def test_unknown_backend_name_lists_the_choices():
    with pytest.raises(ValueError, match="unknown attn_backend='flashy'.*sdpa.*auto"):
        resolve_backend("flashy", torch.device("cpu"))
    with pytest.raises(ValueError, match="expected a resolved backend"):
        build_attention_metadata(make_batch([[L]]), "auto")


def test_flash_on_cpu_says_it_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device.*flash-attn.*this device is cpu"):
        resolve_backend("flash", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        build_attention_metadata(make_batch([[L]]), "flash")


def test_flex_on_cpu_refuses_gradients_and_names_sdpa():
    batch = make_batch([[L]])
    q, k, v = make_qkv(1)
    meta = build_attention_metadata(batch, "flex")
    with pytest.raises(RuntimeError, match="no CPU FlexAttention backward.*'sdpa'"):
        attention(q.requires_grad_(True), k, v, meta)
    with torch.no_grad():  # evaluation of a model whose weights require grad still works
        assert attention(q, k, v, meta).shape == q.shape


def test_long_sequences_refused_by_dense_backends_on_cpu():
    batch = make_batch([[DENSE_MASK_MAX_LEN + 1]], DENSE_MASK_MAX_LEN + 1)
    with pytest.raises(
        ValueError, match=f"refuses L={DENSE_MASK_MAX_LEN + 1} > {DENSE_MASK_MAX_LEN}"
    ):
        build_attention_metadata(batch, "eager")
    with pytest.raises(ValueError, match="flex.*refuses L="):
        build_attention_metadata(batch, "flex")


def test_flash_refuses_fp32_naming_dtype():
    meta = AttentionMetadata(get_backend("flash"), 1, L, torch.device("cpu"))
    q, k, v = make_qkv(1)
    with pytest.raises(ValueError, match="'flash' does not support dtype torch.float32"):
        attention(q, k, v, meta)


# ---------------------------------------------------------------------- input checking
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sequence_length_mismatch_is_an_error(backend):
    meta = build_attention_metadata(make_batch([[L]]), backend)
    q, k, v = make_qkv(1, L)
    with pytest.raises(ValueError, match="must share \\[B, L\\].*L=200"):
        attention(q, k[:, :-1], v[:, :-1], meta)
    q2, k2, v2 = make_qkv(1, L - 1)
    with pytest.raises(ValueError, match="L=200"):
        attention(q2, k2, v2, meta)


def test_heads_not_a_multiple_of_kv_heads_is_an_error():
    meta = build_attention_metadata(make_batch([[L]]), "sdpa")
    q = torch.randn(1, L, 3, D)
    k = v = torch.randn(1, L, 2, D)
    with pytest.raises(ValueError, match="H=3 heads, not a multiple of the k/v heads Hkv=2"):
        attention(q, k, v, meta)


def test_other_shape_and_dtype_errors():
    meta = build_attention_metadata(make_batch([[L]]), "sdpa")
    q, k, v = make_qkv(1)
    with pytest.raises(ValueError, match="expects q \\[B, L, H, D\\]"):
        attention(q[0], k, v, meta)
    with pytest.raises(ValueError, match="head dim D=16 differs"):
        attention(q, k[..., :8], v[..., :8], meta)
    with pytest.raises(ValueError, match="dtypes differ"):
        attention(q, k.double(), v, meta)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        attention(q.long(), k.long(), v.long(), meta)


def test_device_mismatch_is_an_error():
    meta = build_attention_metadata(make_batch([[L]]), "sdpa")
    q, k, v = (torch.empty(t.shape, device="meta") for t in make_qkv(1))
    with pytest.raises(ValueError, match="built for a batch on cpu"):
        attention(q, k, v, meta)


def test_backend_registry_names():
    assert ATTENTION_BACKENDS == ("flash", "flex", "sdpa", "eager")
    assert [(name, b.name) for name, b in backends().items()] == [
        (name, name) for name in ATTENTION_BACKENDS
    ]


def test_flex_asks_whole_blocks_per_context_parallel_chunk():
    flex, cuda = get_backend("flex"), torch.device("cuda")  # a check only: nothing runs
    with pytest.raises(ValueError, match=r"L=256 to be a multiple of 4 chunk\(s\) x 128 = 512"):
        flex.check(cuda, 256, chunks=4)
    flex.check(cuda, 512, chunks=4)
    flex.check(cuda, L)  # a whole row needs no whole blocks outside training
    with pytest.raises(ValueError, match="multiple of 1 chunk"):
        flex.check(cuda, L, training=True)
