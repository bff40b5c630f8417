"""Hugging Face interop: tiny random LlamaForCausalLM folders load to the same logits, and
save_hf writes folders transformers loads back to the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from longctx.batch import PackedBatch
from longctx.hf.checkpoint import save_hf
from longctx.hf.weight_source import load_hf
from longctx.model import Llama, RopeScaling

transformers = pytest.importorskip("transformers")

HF_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.15,  # large enough that attention patterns are far from uniform
)
HF_CONFIGS = {
    "gqa": dict(rope_theta=10000.0),
    # with head_dim 16 and theta 1e4, original 64 puts frequencies in all three llama3 bands
    "llama3_tied": dict(
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
}
ROWS = [[5, 7, 3], [11, 13]]  # row 0 has a 9-token tail segment


def hf_model(kind: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF_BASE, **HF_CONFIGS[kind])
    return transformers.LlamaForCausalLM(config).eval()


def make_batch(reset: bool) -> PackedBatch:
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    return PackedBatch.from_lengths(tokens, ROWS, reset_position_ids=reset)


def documents(batch: PackedBatch):
    for row, lens in enumerate(batch.seq_lens.tolist()):
        start = 0
        for n in (n for n in lens if n > 0):
            yield row, slice(start, start + n)
            start += n


def hf_document_logits(model, batch: PackedBatch, row: int, sl: slice) -> torch.Tensor:
    out = model(
        input_ids=batch.tokens[row : row + 1, sl],
        position_ids=batch.position_ids[row : row + 1, sl],
        use_cache=False,
    )
    return out.logits[0]


def assert_same_per_document(ours: Llama, theirs, reset: bool) -> None:
    batch = make_batch(reset)
    with torch.no_grad():
        packed = ours.eval()(batch)
        for row, sl in documents(batch):
            diff = (packed[row, sl] - hf_document_logits(theirs, batch, row, sl)).abs().max()
            assert diff <= 1e-5 * packed.abs().max(), (row, sl, diff)
    assert packed.abs().max() > 0.5  # real signal, so the bound is meaningful


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def saved_hf(request, tmp_path_factory):
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_from_hf_gives_transformers_logits_per_document(saved_hf, backend, reset):
    _, theirs, path = saved_hf
    ours = load_hf(path, attn_backend=backend)
    assert ours.config.attn_backend == backend
    assert_same_per_document(ours, theirs, reset)


def test_from_hf_reads_the_config(saved_hf):
    kind, _, path = saved_hf
    config = load_hf(path).config
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 2, 4, 2)
    assert (config.vocab_size, config.ffn_dim, config.max_seq_len) == (97, 96, 256)
    assert config.rope_theta == 10000.0 and config.norm_eps == 1e-5
    if kind == "llama3_tied":
        assert config.tie_embeddings
        assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
    else:
        assert not config.tie_embeddings and config.rope_scaling is None


def test_from_hf_reads_sharded_checkpoints(tmp_path):
    theirs = hf_model("gqa")
    theirs.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_same_per_document(load_hf(tmp_path, attn_backend="sdpa"), theirs, reset=True)


@pytest.mark.parametrize("kind", sorted(HF_CONFIGS))
def test_save_hf_loads_in_transformers_with_same_logits(kind, tmp_path):
    ours = load_hf(_saved(hf_model(kind), tmp_path / "src"), attn_backend="sdpa")
    save_hf(ours, tmp_path / "out")
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert theirs.config.tie_word_embeddings == ours.config.tie_embeddings
    assert_same_per_document(ours, theirs, reset=False)
    again = load_hf(tmp_path / "out")
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def test_from_hf_overrides_config_fields(saved_hf):
    _, _, path = saved_hf
    config = load_hf(path, max_seq_len=4096, loss_chunk_size=8).config
    assert config.max_seq_len == 4096 and config.loss_chunk_size == 8
    with pytest.raises(ValueError, match=r"unknown LlamaConfig overrides \['hidden'\]"):
        load_hf(path, hidden=3)


def test_from_hf_overrides_follow_the_preset_rules(saved_hf):
    """One override rule for presets and checkpoints: None keeps the checkpoint's value, a
    rope_scaling dict is merged into the checkpoint's scaling."""
    kind, _, path = saved_hf
    config = load_hf(path, rope_theta=None, rope_scaling={"factor": 16.0}).config
    assert config.rope_theta == 10000.0 and config.rope_scaling.factor == 16.0
    original = 64 if kind == "llama3_tied" else RopeScaling().original_max_position
    assert config.rope_scaling.original_max_position == original


def test_from_hf_reads_transformers_4_style_rope_config(tmp_path):
    path = _saved(hf_model("llama3_tied"), tmp_path)
    hf = json.loads((path / "config.json").read_text())
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    hf["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(hf))
    config = load_hf(path).config
    assert config.rope_theta == 10000.0 and config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


# --------------------------------------------------------------------------- errors
def test_from_hf_lists_missing_and_unexpected_keys(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _saved(hf_model("gqa"), tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    del state["model.norm.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\].*q_proj.bias"):
        load_hf(path)


def test_from_hf_rejects_unsupported_configs(tmp_path):
    path = _saved(hf_model("gqa"), tmp_path)
    hf = json.loads((path / "config.json").read_text())
    hf["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    hf["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="attention_bias=True"):
        load_hf(path)
    hf["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unsupported RoPE type 'dynamic'"):
        load_hf(path)


def test_from_hf_rejects_folders_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_model("gqa").config.to_dict()))
    with pytest.raises(ValueError, match=r"config.json but no \*.safetensors"):
        load_hf(tmp_path)


def _saved(model, path):
    model.save_pretrained(path)
    return path
