"""The Llama model over packed batches: packed == per-document, chunked loss, config, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_scaled
from module_fixtures import small_fields

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.model import Llama, LlamaConfig, RopeScaling, estimate_flops
from longctx.model.attention import build_attention_metadata
from longctx.model.loss import chunked_token_loss

SMALL = small_fields(ffn_dim=96, attn_backend=None)
# Larger than the 0.02 default so attention is far from uniform and a leak shows in the logits.
INIT_STD = 0.15
ROWS = [[5, 7, 3], [11, 13]]  # odd lengths; row 0 gets a 9-token pad tail (L = 24)
PAD_ROW, PAD_LEN = 0, 9


def _flex_forward_supported() -> bool:
    batch = PackedBatch.from_lengths(torch.zeros(1, 4, dtype=torch.long), [[4]], True)
    try:
        build_attention_metadata(batch, "flex")
    except (NotImplementedError, RuntimeError, ImportError):
        return False
    return True


TRAIN_BACKENDS = ["sdpa", "eager"]
FORWARD_BACKENDS = TRAIN_BACKENDS + (["flex"] if _flex_forward_supported() else [])


def make_model(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**SMALL, "init_std": INIT_STD, **overrides})
    return Llama(config)


def make_batch(reset: bool, seed: int = 1) -> PackedBatch:
    """B=2, L=24: documents of odd lengths and a pad tail whose labels are all -100."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=g)
    batch = PackedBatch.from_lengths(tokens, ROWS, reset_position_ids=reset)
    batch.labels[PAD_ROW, -PAD_LEN:] = IGNORE_INDEX
    return batch


def segments(batch: PackedBatch) -> list[tuple[int, slice]]:
    out = []
    for row, lens in enumerate(batch.seq_lens.tolist()):
        start = 0
        for n in (n for n in lens if n > 0):
            out.append((row, slice(start, start + n)))
            start += n
    return out


def alone(batch: PackedBatch, row: int, sl: slice) -> PackedBatch:
    """One segment of ``batch`` as a batch of its own: B=1, one segment, same position ids."""
    cut = lambda t: t[row : row + 1, sl].clone()  # noqa: E731
    n = sl.stop - sl.start
    return PackedBatch(cut(batch.tokens), cut(batch.labels), cut(batch.position_ids),
                       torch.tensor([[n]], dtype=torch.int32))  # fmt: skip


def grads(model: Llama) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- packed == unpacked
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_packed_logits_equal_per_document_logits(backend, reset):
    model = make_model(attn_backend=backend).eval()
    batch = make_batch(reset)
    with torch.no_grad():
        packed = model(batch)
        for row, sl in segments(batch):
            single = model(alone(batch, row, sl))[0]
            assert (packed[row, sl] - single).abs().max() <= 1e-5, (row, sl)
    assert packed.abs().max() > 0.5  # the logits carry signal, so 1e-5 is a real bound


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
@pytest.mark.parametrize("backend", TRAIN_BACKENDS)
def test_packed_loss_and_grads_equal_per_document(backend, reset):
    model = make_model(attn_backend=backend, loss_chunk_size=7)
    batch = make_batch(reset)
    loss_sum, count = model.loss(batch)
    (loss_sum / count).backward()
    packed_loss, packed_grads = (loss_sum / count).item(), grads(model)

    model.zero_grad()
    sums, total = [], 0
    for row, sl in segments(batch):
        s, n = model.loss(alone(batch, row, sl))
        sums.append(s)
        total += n
    assert total == count == 2 * 24 - 5 - 9  # 5 documents lose their last label, pad loses 9
    (torch.stack(sums).sum() / total).backward()

    assert packed_loss == pytest.approx((torch.stack(sums).sum() / total).item(), rel=1e-6)
    for name, g in grads(model).items():
        assert_close_scaled(packed_grads[name], g, msg=name)


@pytest.mark.parametrize("backend", FORWARD_BACKENDS)
def test_one_segment_per_row_is_plain_causal_and_differs_from_masked(backend):
    model = make_model(attn_backend=backend).eval()
    masked = make_batch(reset=False)
    whole = PackedBatch.from_lengths(masked.tokens, [[24], [24]], reset_position_ids=False)
    with torch.no_grad():
        whole_logits = model(whole)
        for row in range(2):
            assert_close_scaled(whole_logits[row], model(alone(whole, row, slice(0, 24)))[0])
        # the first document of each row sees nothing else either way; later tokens differ
        leak = (whole_logits - model(masked)).abs().amax(-1)
    assert leak[:, :5].max() <= 1e-5 * whole_logits.abs().max()
    assert leak[0, 5:].min() > 1e-3 and leak[1, 11:].min() > 1e-3


def test_activation_checkpointing_gives_same_loss_and_grads():
    results = []
    for ckpt in (False, True):
        model = make_model(activation_checkpointing=ckpt).train()
        loss_sum, count = model.loss(make_batch(reset=True))
        (loss_sum / count).backward()
        results.append((loss_sum.item(), grads(model)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for name, g in results[0][1].items():
        assert_close_scaled(results[1][1][name], g, msg=name)


# --------------------------------------------------------------------------- chunked loss
def test_chunked_loss_equals_full_cross_entropy_with_uneven_chunks():
    model = make_model(loss_chunk_size=5)  # 48 tokens: chunks of 5 do not divide B*L
    batch = make_batch(reset=True)
    loss_sum, count = model.loss(batch)
    loss_sum.backward()
    chunked_grads = grads(model)

    model.zero_grad()
    logits = model(batch).float()
    full = F.cross_entropy(
        logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    full.backward()
    assert count == int((batch.labels != IGNORE_INDEX).sum())
    assert loss_sum.dtype == torch.float32
    assert_close_scaled(loss_sum, full, rel=1e-6)
    for name, g in grads(model).items():
        assert_close_scaled(chunked_grads[name], g, msg=name)


def test_token_loss_is_per_token_and_zero_where_ignored():
    model = make_model(loss_chunk_size=5)
    batch = make_batch(reset=True)
    token_loss = model.token_loss(batch)
    assert token_loss.shape == batch.shape and token_loss.dtype == torch.float32
    ignored = batch.labels == IGNORE_INDEX
    assert (token_loss[ignored] == 0).all() and (token_loss[~ignored] > 0).all()
    expected = F.cross_entropy(
        model(batch).transpose(1, 2), batch.labels, ignore_index=IGNORE_INDEX, reduction="none"
    )
    assert_close_scaled(token_loss, expected)


def test_chunked_loss_saves_no_full_logits_for_backward():
    """Outside the per-chunk checkpoints nothing of size N x V is kept for backward."""
    n, dim, vocab, chunk = 64, 8, 1000, 16
    hidden = torch.randn(n, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_token_loss(hidden, weight, torch.randint(0, vocab, (n,)), chunk).sum()
    loss.backward()
    assert max(saved, default=0) < chunk * vocab  # not even one chunk's logits is kept
    assert hidden.grad is not None and weight.grad is not None


def test_chunked_loss_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_token_loss(torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(4).long(), 0)


# --------------------------------------------------------------------------- RoPE positions
def test_positions_up_to_max_seq_len_work():
    model = make_model().eval()
    tokens = torch.randint(0, 97, (1, 16))
    pos = torch.arange(131072 - 16, 131072).unsqueeze(0)
    batch = PackedBatch(tokens, tokens.clone(), pos, torch.tensor([[16]], dtype=torch.int32))
    with torch.no_grad():
        assert torch.isfinite(model(batch)).all()


def test_rope_scaling_changes_the_logits():
    batch = make_batch(reset=False)
    with torch.no_grad():
        plain = make_model().eval()(batch)
        scaled = make_model(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)).eval()(batch)
    assert (plain - scaled).abs().max() > 1e-3


# --------------------------------------------------------------------------- bad input
def test_rejects_batch_longer_than_max_seq_len():
    model = make_model(max_seq_len=16)
    with pytest.raises(ValueError, match="L=24 > max_seq_len=16"):
        model(make_batch(reset=True))


def test_rejects_position_ids_beyond_max_seq_len():
    model = make_model(max_seq_len=24)
    batch = make_batch(reset=True)
    batch.position_ids[1, 3] = 24
    with pytest.raises(ValueError, match=r"position ids span \[0, 24\].*max_seq_len=24"):
        model(batch)


@pytest.mark.parametrize("bad", [97, -1])
def test_rejects_token_ids_outside_vocab(bad):
    batch = make_batch(reset=True)
    batch.tokens[0, 2] = bad
    with pytest.raises(ValueError, match=f"token ids span .*{bad}.*vocab_size=97"):
        make_model()(batch)


def test_rejects_batch_on_another_device():
    model = make_model().to("meta")
    with pytest.raises(ValueError, match="batch is on cpu but the model is on meta"):
        model(make_batch(reset=True))


def test_backend_unavailable_on_device_is_an_error():
    with pytest.raises((ValueError, RuntimeError), match="flash"):
        make_model(attn_backend="flash")(make_batch(reset=True))


def test_eager_refuses_long_sequences():
    model = make_model(attn_backend="eager")
    length = 8193
    batch = PackedBatch.from_lengths(torch.zeros(1, length, dtype=torch.long), [[length]], True)
    with pytest.raises(ValueError, match="eager.*L=8193"):
        model(batch)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dim", 66, "dim=66 is not divisible by n_heads=4"),
        ("n_kv_heads", 3, "n_heads=4 is not divisible by n_kv_heads=3"),
        ("dim", 4 * 9, "head_dim = dim / n_heads = 9 is odd"),
        ("vocab_size", 0, "vocab_size=0"),
        ("n_layers", -1, "n_layers=-1"),
        ("ffn_dim", 2.5, "ffn_dim=2.5"),
        ("loss_chunk_size", 0, "loss_chunk_size=0"),
        ("norm_eps", 0.0, "norm_eps=0.0"),
        ("attn_backend", "cuda", "unknown attn_backend='cuda'"),
        ("rope_scaling", 3, "rope_scaling=3"),
    ],
)
def test_config_rejects_bad_fields(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LlamaConfig(**{**SMALL, field: value})


def test_config_accepts_rope_scaling_as_dict():
    config = LlamaConfig(**SMALL, rope_scaling={"factor": 32.0, "original_max_position": 4096})
    assert config.rope_scaling == RopeScaling(factor=32.0, original_max_position=4096)
    with pytest.raises(ValueError, match="high_freq_factor=1.0 must be greater"):
        LlamaConfig(**SMALL, rope_scaling={"low_freq_factor": 2.0, "high_freq_factor": 1.0})


def test_from_name_presets_and_errors():
    tiny = LlamaConfig.from_name("tiny", attn_backend="eager")
    assert (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.vocab_size) == (
        256, 4, 4, 2, 512
    )  # fmt: skip
    assert tiny.attn_backend == "eager" and tiny.ffn_dim == 768
    one_b = LlamaConfig.from_name("llama3_1b")
    assert one_b.tie_embeddings and one_b.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert one_b.rope_scaling is not LlamaConfig.from_name("llama3_1b").rope_scaling
    with pytest.raises(ValueError, match=r"unknown model preset 'llama9'.*'llama3_1b'"):
        LlamaConfig.from_name("llama9")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig overrides \['depth'\]"):
        LlamaConfig.from_name("tiny", depth=3)


@pytest.mark.parametrize("name", ["tiny", "llama3_1b", "llama3_8b"])
def test_num_params_is_exact_on_meta_device(name):
    config = LlamaConfig.from_name(name)
    with torch.device("meta"):
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    if name == "llama3_8b":
        assert config.num_params() == 8_030_261_248


# --------------------------------------------------------------------------- init
def test_reset_parameters_is_deterministic_and_meta_friendly():
    config = LlamaConfig(**{**SMALL, "n_layers": 8})
    torch.manual_seed(3)
    eager_model = Llama(config)
    with torch.device("meta"):
        meta_model = Llama(config)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(3)
    meta_model.reset_parameters()
    meta_state = meta_model.state_dict()
    for name, tensor in eager_model.state_dict().items():
        assert torch.equal(tensor, meta_state[name]), name
    layer = eager_model.layers[0]
    assert torch.equal(layer.attention_norm.weight, torch.ones(64))
    assert layer.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert layer.attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)  # 1/sqrt(2*8)


def test_tied_embeddings_share_the_output_weight():
    model = make_model(tie_embeddings=True)
    assert model.output is None and model.output_weight is model.tok_embeddings.weight


# --------------------------------------------------------------------------- flops
def test_estimate_flops_matches_hand_computation():
    config = LlamaConfig(vocab_size=10, dim=8, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=12)
    seq_lens = torch.tensor([[3, 5, 0], [8, 0, 0]], dtype=torch.int32)
    # per layer: wq 64 + wk 32 + wv 32 + wo 64 + ffn 3*96 + norms 16 = 496; x3 + final norm 8
    # + lm head 80 (the input embedding is a lookup, not a matmul)
    dense = 6 * (3 * 496 + 8 + 80) * 16
    pairs = (9 + 25 + 64) / 2
    attn = 3 * 3 * pairs * 2 * (2 * 4) * 2  # 3x (fwd+bwd), 3 layers, QK+PV, 2*D, 2 heads
    assert estimate_flops(config, seq_lens) == pytest.approx(dense + attn)
    tied = dataclasses.replace(config, tie_embeddings=True)
    assert estimate_flops(tied, seq_lens) == pytest.approx(dense + attn)


# --------------------------------------------------------------------------- low precision
def test_bf16_model_trains_with_fp32_loss_close_to_fp32():
    batch = make_batch(reset=True)
    fp32_loss = make_model().loss(batch)[0].item()
    model = make_model().to(torch.bfloat16)
    loss_sum, _ = model.loss(batch)
    loss_sum.backward()
    assert loss_sum.dtype == torch.float32
    assert loss_sum.item() == pytest.approx(fp32_loss, rel=2e-2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# --------------------------------------------------------------------------- GPU
CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "flex", "sdpa"])
def test_gpu_bf16_packed_equals_per_document(backend):
    from longctx.model.attention import resolve_backend

    try:
        resolve_backend(backend, torch.device("cuda"))
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"{backend} unavailable: {err}")
    model = make_model(attn_backend=backend).cuda().to(torch.bfloat16).eval()
    batch = make_batch(reset=False).to("cuda")
    with torch.no_grad():
        packed = model(batch).float()
        for row, sl in segments(batch):
            single = model(alone(batch, row, sl))[0].float()
            torch.testing.assert_close(packed[row, sl], single, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_flash_refuses_fp32():
    from longctx.model.attention import resolve_backend

    try:
        resolve_backend("flash", torch.device("cuda"))
    except (RuntimeError, ValueError) as err:
        pytest.skip(f"flash unavailable: {err}")
    model = make_model(attn_backend="flash").cuda()
    with pytest.raises(ValueError, match="flash.*float32"):
        model(make_batch(reset=True).to("cuda"))


def test_autocast_keeps_attention_inputs_in_low_precision(monkeypatch):
    import longctx.model.llama as llama_module

    seen, original = [], llama_module.attention

    def recording_attention(q, k, v, meta):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, meta)

    monkeypatch.setattr(llama_module, "attention", recording_attention)
    model = make_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sum, _ = model.loss(make_batch(reset=True))
    loss_sum.backward()
    assert seen == [(torch.bfloat16,) * 3] * SMALL["n_layers"]
    assert loss_sum.dtype == torch.float32


def _rms_norm_formula(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_rms_norm_backward_passes_gradcheck():
    from longctx.model.llama import RMSNormFunction

    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(RMSNormFunction.apply, (x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_formula_values_and_grads(dtype):
    from longctx.model.llama import RMSNorm

    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(16))
    x = (3 * torch.randn(3, 7, 16)).to(dtype).requires_grad_()
    grad = torch.randn(3, 7, 16)
    out = norm(x)
    (out * grad).sum().backward()
    got = out.detach(), x.grad, norm.weight.grad
    x.grad, norm.weight.grad = None, None
    ref = _rms_norm_formula(x, norm.weight, 1e-5)
    (ref * grad).sum().backward()
    assert out.dtype == ref.dtype  # fp32 weight: fp32 output, as in transformers
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, (ref.detach(), x.grad, norm.weight.grad), strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
