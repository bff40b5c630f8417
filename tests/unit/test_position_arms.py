"""What the two toggles compute: under document masks reset and continuous positions are the same
function (to fp32 rounding, with exact RoPE angles), without them different models; exact angles
against an fp64 reference; every arm scored on held-out documents equals each document alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from module_fixtures import small_fields

from longctx.batch import PackedBatch
from longctx.eval.documents import document_batches, mean_loss, score_documents
from longctx.model import Llama, LlamaConfig
from longctx.model.rope import inv_frequencies, rope_cos_sin

# small enough for a 32k row with gradients on 2 cores; RoPE over head_dim 32 (16 frequencies)
SMALL = small_fields(vocab_size=64, n_heads=2, n_kv_heads=1, attn_backend=None,
                     max_seq_len=131072, loss_chunk_size=131072, init_std=0.1)  # fmt: skip


def model_for(backend: str, **overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**SMALL, "attn_backend": backend, **overrides}))


def document_lengths(length: int, seed: int = 0) -> list[int]:
    """Lognormal documents (median 600) filling the row; the last one cut to fit."""
    rng = np.random.default_rng(seed)
    lens, total = [], 0
    while total < length:
        n = int(min(max(rng.lognormal(np.log(600), 1.0), 8), length - total))
        lens.append(n)
        total += n
    return lens


def arm_batch(length: int, reset: bool, mask: bool) -> PackedBatch:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SMALL["vocab_size"], (1, length), generator=gen)
    batch = PackedBatch.from_lengths(tokens, [document_lengths(length)], reset)
    if mask:
        return batch
    return dataclasses.replace(batch, seq_lens=torch.tensor([[length]], dtype=torch.int32))


def logits_and_grads(model: Llama, batch: PackedBatch, grads: bool):
    model.zero_grad()
    if not grads:
        with torch.no_grad():
            return model(batch), None
    logits = model(batch)
    loss_sum, n = model.loss(batch)
    (loss_sum / n).backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the largest magnitude compared."""
    return float((a - b).abs().max() / a.abs().max())


# sdpa (the CPU training path) at a 32k row; eager builds a dense [L, L] mask and uncompiled CPU
# flex materialises [H, L, L] scores (it refuses rows past 8k, and has no CPU backward), so they
# are checked at shorter rows
MASKED = [("sdpa", 32768, True), ("flex", 8192, False), ("eager", 4096, True)]


@pytest.mark.slow
@pytest.mark.parametrize("backend, length, grads", MASKED, ids=[c[0] for c in MASKED])
def test_masked_arms_are_one_function(backend, length, grads):
    model = model_for(backend)
    reset_logits, reset_grads = logits_and_grads(model, arm_batch(length, True, True), grads)
    cont_logits, cont_grads = logits_and_grads(model, arm_batch(length, False, True), grads)
    assert relative_gap(reset_logits, cont_logits) < 2e-5  # fp32 rounding
    if grads:
        assert relative_gap(reset_grads, cont_grads) < 2e-4


@pytest.mark.parametrize("backend, grads", [("sdpa", True), ("flex", False), ("eager", True)])
def test_unmasked_arms_are_different_models(backend, grads):
    model = model_for(backend)
    reset = logits_and_grads(model, arm_batch(4096, True, False), grads)
    continuous = logits_and_grads(model, arm_batch(4096, False, False), grads)
    assert relative_gap(reset[0], continuous[0]) > 1e-2
    if grads:
        assert relative_gap(reset[1], continuous[1]) > 1e-2


def test_exact_angles_match_an_fp64_reference_at_128k():
    config = LlamaConfig.from_name("llama3_8b")  # head_dim 128, Llama 3.1 scaled frequencies
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    positions = torch.arange(131072).unsqueeze(0)
    angles = positions.double().squeeze(0)[:, None] * inv_freq.double()  # exact in fp64
    ref_cos, ref_sin = angles.cos(), angles.sin()

    def error(exact: bool) -> float:
        cos, sin = rope_cos_sin(inv_freq, positions, torch.float32, exact_angles=exact)
        return max((cos[0].double() - ref_cos).abs().max(), (sin[0].double() - ref_sin).abs().max())

    assert error(exact=True) < 1e-7  # one rounding of a value in [-1, 1] to fp32: half an ulp
    assert error(exact=False) > 1e-3  # fp32 products near position 131,071 are off by ~8e-3 rad


def test_exact_angles_are_the_default_and_fp32_angles_stay_available():
    assert LlamaConfig(**SMALL).exact_rope_angles is True
    batch = arm_batch(4096, reset=False, mask=True)
    with torch.no_grad():
        exact = model_for("sdpa")(batch)
        rounded = model_for("sdpa", exact_rope_angles=False)(batch)
    assert 0 < relative_gap(exact, rounded) < 1e-2  # a rounding-size difference, not a new model


def test_held_out_documents_scored_together_equal_each_document_alone():
    model = model_for("sdpa").eval()
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, size=n) for n in (5, 300, 1, 90, 700, 40, 129)]
    batches = document_batches(docs, seq_len=512, rows_per_batch=2, pad_id=0)
    assert sum(len(rows) for _, rows in batches) >= 3  # several rows, several batches
    records = score_documents(model, batches, torch.device("cpu"))
    for i, doc in enumerate(docs):
        kept = torch.from_numpy(doc[:512]).unsqueeze(0)
        alone = PackedBatch.from_lengths(kept, [[kept.shape[1]]], reset_position_ids=True)
        with torch.no_grad():
            total, n = model.loss(alone)
        mine = [r for r in records if r["doc"] == i]
        assert sum(r["tokens"] for r in mine) == n  # a 1-token document has no target
        if n:
            assert sum(r["loss_sum"] for r in mine) == pytest.approx(float(total), rel=1e-5)
    assert mean_loss(records) == pytest.approx(
        sum(r["loss_sum"] for r in records) / sum(r["tokens"] for r in records)
    )
    # a document longer than the row keeps its first seq_len tokens
    assert {r["doc"] for r in records} == {0, 1, 3, 4, 5, 6}
