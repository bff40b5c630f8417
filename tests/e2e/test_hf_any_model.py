"""Any HF causal LM on PackedBatch: packed == per-document against HF's own attention, the leak
it fixes, from_features / to_hf_kwargs, refused architectures, train.py model=hf."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import FAST, assert_close_scaled, compose, run_train
from hf_features import from_features, to_hf_kwargs

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.hf.adapter import (
    HFCausalLM,
    HFModelSpec,
    UnsupportedModelError,
    load_hf_causal_lm,
    load_hf_config,
)

VOCAB = 300  # covers the byte tokenizer's 259 ids
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # q/k/v biases
    # Mistral passes sliding_window=4096 to attention: a no-op for these short documents
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
    # Gemma: sqrt(dim)-scaled embeddings, (1 + w) norms, tied head, head_dim != dim / heads
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {"head_dim": 32}),
    # Granite: attention scale != 1/sqrt(D), logits divided by logits_scaling
    "granite": (
        transformers.GraniteConfig,
        transformers.GraniteForCausalLM,
        {"attention_multiplier": 0.3, "logits_scaling": 4.0, "embedding_multiplier": 2.0},
    ),
}
FEATURE_LENGTHS = [12, 20, 9, 30]  # rows of 48: [12, 20, 9, pad 7], [30, pad 18]


def save_family(name: str, folder) -> str:
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model_cls(config_cls(**SHAPE, **extra)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=list(FAMILIES))
def models(request, tmp_path_factory):
    """(longctx-wrapped model, the same weights under HF's own SDPA) for one family."""
    path = save_family(request.param, tmp_path_factory.mktemp(request.param))
    model = load_hf_causal_lm(path, attn_backend="sdpa", loss_chunk_size=16).eval()
    return model, reference_model(path)


def features_batch(reset: bool, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g)} for n in FEATURE_LENGTHS]
    return from_features(features, 48, reset_position_ids=reset, pad_id=0)


def reference_model(path: str):
    """The same weights under transformers' own SDPA attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def per_document(ref, batch: PackedBatch) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each segment run alone through HF (same position ids): logits per segment, loss sum."""
    logits, loss = [], torch.zeros(())
    for r, row in enumerate(batch.seq_lens.tolist()):
        start = 0
        for n in (n for n in row if n):
            sl = slice(start, start + n)
            out = ref(
                input_ids=batch.tokens[r : r + 1, sl],
                position_ids=batch.position_ids[r : r + 1, sl],
                use_cache=False,
            ).logits[0]
            labels = batch.labels[r, sl]
            loss = loss + F.cross_entropy(out, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            logits.append(out)
            start += n
    return logits, loss


def segments(t_BL: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    return [
        piece
        for r, row in enumerate(batch.seq_lens.tolist())
        for piece in t_BL[r].split([n for n in row if n])
    ]


# ------------------------------------------------------------------ packed == per document
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
def test_packed_equals_per_document(models, reset):
    model, ref = models
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    batch = features_batch(reset)
    assert batch.shape == (2, 48) and batch.num_segments == 6  # B > 1, pad tails

    ref_logits, ref_loss = per_document(ref, batch)
    for got, want in zip(segments(model(batch), batch), ref_logits, strict=True):
        assert_close_scaled(got, want)

    loss_sum, num_tokens = model.loss(batch)
    assert_close_scaled(loss_sum, ref_loss)
    assert num_tokens == sum(FEATURE_LENGTHS) - len(FEATURE_LENGTHS)
    loss_sum.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.hf_model.named_parameters():
        assert_close_scaled(p.grad, ref_params[name].grad, msg=name)


def test_eager_and_sdpa_backends_agree(tmp_path):
    model = load_hf_causal_lm(save_family("llama", tmp_path), attn_backend="sdpa")
    batch = features_batch(reset=False)
    sdpa = model.token_loss(batch)
    model.attn_backend = "eager"
    assert_close_scaled(model.token_loss(batch), sdpa)


def test_activation_checkpointing_keeps_loss_and_gradients(tmp_path):
    path = save_family("llama", tmp_path)
    batch = features_batch(reset=False)
    grads = []
    for checkpointing in (False, True):
        model = load_hf_causal_lm(path, attn_backend="sdpa", activation_checkpointing=checkpointing)
        model.train()  # HF checkpoints layers only in training mode
        model.loss(batch)[0].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert_close_scaled(grads[1][name], grad, msg=name)


# ------------------------------------------------------------------ the leak it fixes
def test_hf_own_attention_leaks_with_continuous_positions(tmp_path):
    path = save_family("llama", tmp_path)
    model, ref = load_hf_causal_lm(path, attn_backend="sdpa").eval(), reference_model(path)
    continuous, reset = features_batch(reset=False), features_batch(reset=True)
    ours = model(continuous)
    with torch.no_grad():
        hf_packed = ref(**to_hf_kwargs(continuous), use_cache=False)
        hf_reset = ref(**to_hf_kwargs(reset), use_cache=False)
    # first document of each row: identical; every later one saw the documents before it
    first = slice(0, FEATURE_LENGTHS[0])
    assert_close_scaled(hf_packed.logits[:, first], ours[:, first])
    later = slice(FEATURE_LENGTHS[0], 48)
    assert (hf_packed.logits[0, later] - ours[0, later]).abs().max() > 1e-2
    # HF masks documents only when positions reset; then its loss is ours (to_hf_kwargs labels)
    loss_sum, num_tokens = model.loss(reset)
    assert_close_scaled(hf_reset.loss, loss_sum / num_tokens)
    assert abs(hf_packed.loss - loss_sum / num_tokens) > 1e-3


# ------------------------------------------------------------------ from_features / to_hf
def test_from_features_rows_labels_positions():
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11]}, {"input_ids": [12, 13]}]
    features[2]["labels"] = [-100, 13]  # HF's unshifted labels: token 12 predicts 13
    batch = from_features(features, 6, reset_position_ids=False, pad_id=1)
    assert batch.tokens.tolist() == [[5, 6, 7, 1, 1, 1], [8, 9, 10, 11, 12, 13]]
    assert batch.seq_lens.tolist() == [[3, 3], [4, 2]]
    no = IGNORE_INDEX
    assert batch.labels.tolist() == [[6, 7, no, no, no, no], [9, 10, 11, no, 13, no]]
    assert batch.position_ids.tolist() == [list(range(6))] * 2  # continuous along the row
    reset = from_features(features, 6, reset_position_ids=True)
    assert reset.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]


def test_from_features_splits_a_long_feature_in_order():
    batch = from_features([{"input_ids": list(range(1, 15))}], 6, True)
    assert batch.tokens.flatten().tolist()[:14] == list(range(1, 15))
    assert batch.seq_lens.tolist() == [[6, 0], [6, 0], [2, 4]]
    assert batch.labels[0].tolist() == [2, 3, 4, 5, 6, IGNORE_INDEX]  # no target across a split


@pytest.mark.parametrize(
    ("features", "seq_len", "match"),
    [
        ([], 8, "non-empty list"),
        ([{"ids": [1]}], 8, "feature 0 has no 'input_ids'"),
        ([{"input_ids": [1]}, {"input_ids": []}], 8, "feature 1 input_ids"),
        ([{"input_ids": [1, -2]}], 8, "feature 0 input_ids"),
        ([{"input_ids": [1, 2], "labels": [2]}], 8, "1 labels for 2 input_ids"),
        ([{"input_ids": [1]}], 0, "seq_len=0"),
    ],
)
def test_from_features_bad_input(features, seq_len, match):
    with pytest.raises(ValueError, match=match):
        from_features(features, seq_len, reset_position_ids=True)


def test_to_hf_kwargs():
    batch = from_features([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], 4, False)
    kw = to_hf_kwargs(batch)
    assert (
        kw["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 8] and kw["cu_seq_lens_q"].dtype == torch.int32
    )
    assert kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    assert kw["max_length_q"] == kw["max_length_k"] == 3
    assert kw["labels"].tolist() == [[-100, 6, 7, -100], [-100, 9, -100, -100]]  # HF unshifted
    assert kw["shift_labels"] is batch.labels
    assert kw["input_ids"] is batch.tokens and kw["position_ids"] is batch.position_ids


# ------------------------------------------------------------------ refusals
STATEFUL = {
    "mamba": lambda: transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2
    ),
    "jamba": lambda: transformers.JambaConfig(vocab_size=VOCAB, hidden_size=32),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32),
    "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(vocab_size=VOCAB),
}


@pytest.mark.parametrize("model_type", list(STATEFUL))
def test_stateful_architectures_are_refused_before_weights(model_type, tmp_path):
    STATEFUL[model_type]().save_pretrained(tmp_path)  # config.json only: no weights needed
    with pytest.raises(UnsupportedModelError, match=f"model_type='{model_type}'"):
        load_hf_causal_lm(tmp_path)
    with pytest.raises(UnsupportedModelError, match="recurrent / linear-attention"):
        HFModelSpec(path=str(tmp_path))


def test_unknown_family_with_linear_attention_layers_is_refused(tmp_path):
    config = transformers.LlamaConfig(**SHAPE)
    config.layer_types = ["full_attention", "linear_attention"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"layer types \['linear_attention'\]"):
        load_hf_config(tmp_path)


def test_soft_capping_is_refused(tmp_path):
    transformers.Gemma2Config(**SHAPE, head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model_type='gemma2'.*soft-capping"):
        load_hf_config(tmp_path)


def test_sliding_window_refused_when_a_document_is_longer(tmp_path):
    config = transformers.MistralConfig(**SHAPE, sliding_window=16)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    model = load_hf_causal_lm(tmp_path, attn_backend="sdpa")
    short = PackedBatch.from_lengths(torch.randint(0, VOCAB, (1, 32)), [[16, 16]], True)
    model.loss(short)  # every document fits the window: the window changes nothing
    long = PackedBatch.from_lengths(torch.randint(0, VOCAB, (1, 32)), [[20, 12]], True)
    with pytest.raises(UnsupportedModelError, match="sliding window of 16 tokens.*document of 20"):
        model.loss(long)
    with pytest.raises(UnsupportedModelError, match="window 16.*seq_len=32"):
        HFModelSpec(path=str(tmp_path)).check_seq_len(32)


def test_direct_hf_call_without_batch_metadata_is_an_error(tmp_path):
    model = load_hf_causal_lm(save_family("llama", tmp_path))
    with pytest.raises(RuntimeError, match="without PackedBatch metadata"):
        model.hf_model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_bad_paths_and_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder with a config.json"):
        HFModelSpec(path=str(tmp_path / "missing"))
    path = save_family("llama", tmp_path)
    with pytest.raises(ValueError, match="attn_backend='fast'"):
        HFModelSpec(path=path, attn_backend="fast")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        load_hf_causal_lm(path, dtype="fp8")
    batch = PackedBatch.from_lengths(torch.full((1, 8), VOCAB), [[8]], True)
    with pytest.raises(ValueError, match=r"token ids span \[300, 300\].*vocab_size=300"):
        load_hf_causal_lm(path).loss(batch)


# ------------------------------------------------------------------ the app: model=hf
def test_spec_answers_preflight_from_config_alone(tmp_path):
    spec = HFModelSpec(path=save_family("qwen2", tmp_path), attn_backend="sdpa")
    model = spec.build()
    assert isinstance(model, HFCausalLM)
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    assert spec.vocab_size == VOCAB and spec.max_seq_len == 32768
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=32768"):
        spec.check_seq_len(65536)


def test_compose_model_hf(tmp_path):
    path = save_family("llama", tmp_path / "ckpt")
    cfg = compose(["model=hf", f"model.path={path}", *FAST], output_dir=tmp_path)
    from hydra.utils import instantiate

    spec = instantiate(cfg.model)
    assert isinstance(spec, HFModelSpec) and spec.path == path


@pytest.mark.slow  # a train.py subprocess: about 20 s on a loaded 2-core machine
def test_train_py_model_hf(tmp_path):
    path = save_family("qwen2", tmp_path / "ckpt")
    args = ["model=hf", f"model.path={path}", "model.attn_backend=sdpa", *FAST]
    args += ["run_name=hf", "data.reset_position_ids=false", "trainer.max_steps=4"]
    run_train(args, tmp_path)
    with open(tmp_path / "outputs" / "train" / "hf" / "csv" / "metrics.csv") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(losses) == 4 and all(loss == loss for loss in losses)


def test_dry_run_and_preflight_model_hf(tmp_path):
    from longctx.train.app import ConfigError, run

    path = save_family("llama", tmp_path / "ckpt")
    overrides = ["model=hf", f"model.path={path}", *FAST, "dry_run=true"]
    report = run(compose(overrides, output_dir=tmp_path))
    assert report["parameters"] == HFModelSpec(path=path).num_params()
    windowed = tmp_path / "windowed"
    transformers.MistralConfig(**SHAPE, sliding_window=64).save_pretrained(windowed)
    overrides = ["model=hf", f"model.path={windowed}", *FAST, "dry_run=true"]
    with pytest.raises(ConfigError, match="sliding-window attention.*seq_len=256"):
        run(compose(overrides, output_dir=tmp_path))
