"""Incremental decoding from longctx's Llama KV cache equals recomputing the whole sequence, in
fp32 on CPU: one document, prefill through packed PackedBatch rows (reset and continuous
positions), GQA, every RoPE scaling, and greedy generation itself."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import ROOT, assert_close_scaled

from longctx.batch import PackedBatch
from longctx.model import Llama, LlamaConfig, RopeScaling
from longctx.model.attention.cached import KVCache
from longctx.model.generate import greedy_generate, greedy_generate_batch

sys.path.insert(0, str(ROOT / "benchmarks"))
from uncached_generate import recompute_generate  # noqa: E402  (benchmarks/, the no-cache reference)

SMALL = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, attn_backend="sdpa"
)
REL = 2e-5  # of the largest |logit|: fp32 round-off of two summation orders
SCALINGS = {
    "none": None,
    "llama3": RopeScaling(factor=4.0, original_max_position=32),
    "linear": RopeScaling(type="linear", factor=2.0),
    "yarn": RopeScaling(type="yarn", factor=4.0, original_max_position=32),
}


def make_model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    # init_std above the default so attention is far from uniform and a wrong key shows
    return Llama(LlamaConfig(**{**SMALL, "init_std": 0.15, **overrides}))


@torch.no_grad()
def full_logits(model: Llama, tokens_BN: torch.Tensor, lengths, reset: bool) -> torch.Tensor:
    return model(PackedBatch.from_lengths(tokens_BN, lengths, reset_position_ids=reset))


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_decoding_one_token_at_a_time_equals_recompute(scaling, kv_heads):
    model = make_model(n_kv_heads=kv_heads, rope_scaling=SCALINGS[scaling]).eval()
    tokens = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(3))
    prompt = 23
    expected = full_logits(model, tokens, [[40]], reset=True)[0]
    logits, cache = model.prefill(
        PackedBatch.from_lengths(tokens[:, :prompt], [[prompt]], True), 40
    )
    assert_close_scaled(logits[0], expected[prompt - 1], REL)
    for i in range(prompt, 40):
        step = model.decode(tokens[:, i : i + 1], cache)[0, 0]
        assert_close_scaled(step, expected[i], REL, msg=f"token {i}")
    assert cache.length == 40 and int(cache.next_position) == 40


@pytest.mark.parametrize("reset", [True, False])
def test_prefill_of_packed_rows_continues_each_rows_last_document(reset):
    """Rows of several documents through the normal PackedBatch path; the new tokens extend each
    row's last document, and the logits equal recomputing the extended rows."""
    model = make_model(n_kv_heads=2).eval()
    g = torch.Generator().manual_seed(5)
    lengths = [[5, 9, 6], [12, 8]]  # prompt rows of 20 tokens; the last documents continue
    tokens = torch.randint(0, 97, (2, 26), generator=g)
    grown = [[5, 9, 12], [12, 14]]
    expected = full_logits(model, tokens, grown, reset)
    logits, cache = model.prefill(PackedBatch.from_lengths(tokens[:, :20], lengths, reset), 26)
    assert_close_scaled(logits, expected[:, 19], REL)
    steps = model.decode(tokens[:, 20:23], cache)  # three tokens at once, then one at a time
    assert_close_scaled(steps, expected[:, 20:23], REL)
    for i in range(23, 26):
        assert_close_scaled(model.decode(tokens[:, i : i + 1], cache)[:, 0], expected[:, i], REL)


def test_the_other_documents_of_a_row_are_not_seen():
    """Changing an earlier document of the row changes nothing that is decoded after it."""
    model = make_model().eval()
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(7))
    other = tokens.clone()
    other[0, :6] = (other[0, :6] + 1) % 97
    outs = []
    for t in (tokens, other):
        _, cache = model.prefill(PackedBatch.from_lengths(t[:, :12], [[6, 6]], True), 16)
        outs.append(model.decode(t[:, 12:16], cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_greedy_generation_equals_greedy_recompute():
    model = make_model(n_kv_heads=1).eval()
    prompt = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(11))
    expected = recompute_generate(model, prompt, 12)
    assert greedy_generate(model, prompt, 12) == expected
    batch = torch.stack([prompt, prompt.flip(0)])
    assert greedy_generate_batch(model, batch, 12) == [
        expected,
        recompute_generate(model, prompt.flip(0), 12),
    ]


def test_generation_stops_at_a_stop_token_and_leaves_it_out():
    model = make_model().eval()
    prompt = torch.randint(0, 97, (10,), generator=torch.Generator().manual_seed(2))
    full = greedy_generate(model, prompt, 8)
    stop = full[3]
    first = full.index(stop)
    assert greedy_generate(model, prompt, 8, stop_ids=[stop]) == full[:first]


def test_the_cache_refuses_what_it_cannot_hold():
    model = make_model().eval()
    tokens = torch.zeros(1, 8, dtype=torch.long)
    _, cache = model.prefill(PackedBatch.from_lengths(tokens, [[8]], True), capacity=9)
    model.decode(tokens[:, :1], cache)
    with pytest.raises(ValueError, match="KV cache holds 9 positions; 10 needed"):
        model.decode(tokens[:, :1], cache)
    with pytest.raises(ValueError, match="prefill the prompt before decoding"):
        model.decode(tokens[:, :1], KVCache(2, 4))
    short = make_model(max_seq_len=8).eval()
    _, cache = short.prefill(PackedBatch.from_lengths(tokens, [[8]], True), capacity=12)
    with pytest.raises(ValueError, match="max_seq_len=8"):
        short.decode(tokens[:, :1], cache)


def test_transformers_generate_writes_the_same_tokens_from_the_same_weights(tmp_path):
    """The --hf path (transformers' own greedy generate on a saved folder) and longctx's KV-cache
    decoding agree token for token on one model (fp32 RoPE angles, as transformers rounds them)."""
    from transformers import AutoModelForCausalLM

    from longctx.eval.ruler.hf import HFScorer
    from longctx.hf.checkpoint import save_hf

    model = make_model(n_kv_heads=2, exact_rope_angles=False).eval()
    save_hf(model, tmp_path / "hf")
    hf = HFScorer(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32))
    prompts = torch.randint(0, 97, (2, 25), generator=torch.Generator().manual_seed(4))
    batch = PackedBatch.from_lengths(prompts, [[25], [25]], reset_position_ids=True)
    assert hf.generate_from_batch(batch, 16) == greedy_generate_batch(model, prompts, 16)
