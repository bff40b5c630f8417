"""RoPE for context extension: every scaling type (and a changed base) gives transformers' own
logits beyond the original length in both position modes; save_hf and model=hf carry the same
settings; bad settings are named."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import assert_close_scaled

from longctx.batch import PackedBatch
from longctx.hf.adapter import HFModelSpec
from longctx.hf.checkpoint import save_hf
from longctx.hf.weight_source import load_hf
from longctx.model import LlamaConfig, RopeScaling
from longctx.model.config import PRESETS

transformers = pytest.importorskip("transformers")

ORIGINAL = 64  # the "pretraining" length; documents below run to 2.5x it
HF_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4 * ORIGINAL,
    rms_norm_eps=1e-5,
    initializer_range=0.15,  # attention far from uniform, so positions matter
)
THETA = 5e4  # not the HF default: the base is read, not assumed
# transformers' rope_scaling dicts; with head_dim 16 each one scales some frequencies and not others
SCALINGS = {
    "default": None,
    "llama3": dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=ORIGINAL,
    ),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    # explicit temperature, other ramp ends, untruncated ramp
    "yarn_custom": dict(
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=ORIGINAL,
        attention_factor=1.3,
        beta_fast=16.0,
        beta_slow=2.0,
        truncate=False,
    ),
}
ROWS = [[150, 10], [100, 60]]  # documents longer than ORIGINAL
LENGTH = 160


def hf_model(kind: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**HF_BASE, rope_theta=THETA, rope_scaling=SCALINGS[kind])
    return transformers.LlamaForCausalLM(config).eval()


def make_batch(reset: bool) -> PackedBatch:
    tokens = torch.randint(0, 97, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    return PackedBatch.from_lengths(tokens, ROWS, reset_position_ids=reset)


def hf_logits_per_document(model, batch: PackedBatch):
    """(row, slice, transformers' logits of that document alone with the batch's positions)."""
    for row, lens in enumerate(batch.seq_lens.tolist()):
        start = 0
        for n in (n for n in lens if n > 0):
            sl = slice(start, start + n)
            out = model(
                input_ids=batch.tokens[row : row + 1, sl],
                position_ids=batch.position_ids[row : row + 1, sl],
                use_cache=False,
            )
            yield row, sl, out.logits[0]
            start += n


def assert_same_logits(ours, theirs, reset: bool) -> None:
    batch = make_batch(reset)
    assert int(batch.position_ids.max()) >= 2 * ORIGINAL  # beyond the original length
    with torch.no_grad():
        packed = ours.eval()(batch)
        scale = packed.abs().max()
        assert scale > 0.5  # real signal, so the relative bound below means something
        for row, sl, expected in hf_logits_per_document(theirs, batch):
            torch.testing.assert_close(
                packed[row, sl], expected, rtol=0, atol=1e-5 * float(scale), msg=(row, sl)
            )


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def saved(request, tmp_path_factory):
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "continuous"])
def test_each_scaling_gives_transformers_logits_beyond_the_original_length(saved, reset):
    kind, theirs, path = saved
    ours = load_hf(path, attn_backend="sdpa")
    expected_type = None if kind == "default" else SCALINGS[kind]["rope_type"]
    assert getattr(ours.config.rope_scaling, "type", None) == expected_type
    assert ours.config.rope_theta == THETA
    assert_same_logits(ours, theirs, reset)


def test_scalings_really_differ(folder):
    """The parity above is not vacuous: each type changes the logits at long positions."""
    batch = make_batch(reset=False)
    with torch.no_grad():
        logits = {k: load_hf(folder(k), attn_backend="sdpa").eval()(batch) for k in SCALINGS}
    kinds = sorted(logits)
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            assert (logits[a] - logits[b]).abs().max() > 1e-2, (a, b)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """folder(kind): a saved tiny checkpoint with that scaling, written once per module."""
    cache: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in cache:
            cache[kind] = str(tmp_path_factory.mktemp(f"rope_{kind}"))
            hf_model(kind).save_pretrained(cache[kind])
        return cache[kind]

    return get


def test_yarn_attention_temperature_is_transformers(saved):
    kind, theirs, path = saved
    scaling = load_hf(path).config.rope_scaling
    expected = theirs.model.rotary_emb.attention_scaling
    assert (1.0 if scaling is None else scaling.attention_scale) == pytest.approx(expected)
    if kind == "yarn":
        assert expected > 1.1  # 0.1 ln 4 + 1


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_save_hf_round_trips_the_rope_settings(kind, tmp_path, folder):
    ours = load_hf(folder(kind), attn_backend="sdpa")
    save_hf(ours, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with its index
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == THETA
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_logits(ours, theirs, reset=False)
    assert load_hf(tmp_path).config.rope_scaling == ours.config.rope_scaling


def test_rope_theta_override_matches_transformers_with_that_base(tmp_path, folder):
    """ABF: the checkpoint's weights with a larger base == transformers given that base."""
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        folder("llama3"), rope_parameters={**SCALINGS["llama3"], "rope_theta": 8e6}
    ).eval()
    assert theirs.config.rope_parameters["rope_theta"] == 8e6
    ours = load_hf(folder("llama3"), attn_backend="sdpa", rope_theta=8e6)
    assert_same_logits(ours, theirs, reset=True)


@pytest.mark.parametrize("kind", ["yarn_custom", "linear"])
def test_model_hf_takes_rope_settings_through_config_overrides(kind, folder):
    """model=hf: config_overrides {rope_theta, rope_scaling} on a checkpoint without scaling give
    the logits of our Llama with the same settings (and transformers' own RoPE for them)."""
    scaling = SCALINGS[kind]
    spec = HFModelSpec(
        path=folder("default"),
        attn_backend="sdpa",
        config_overrides={"rope_theta": 2e5, "rope_scaling": dict(scaling)},
    )
    assert spec.hf_config.rope_parameters == {**scaling, "rope_theta": 2e5} | (
        {"original_max_position_embeddings": ORIGINAL} if "original" in str(scaling) else {}
    )
    ours = load_hf(
        folder("default"),
        attn_backend="sdpa",
        rope_theta=2e5,
        rope_scaling=RopeScaling.from_hf(scaling, 4 * ORIGINAL),
    )
    theirs = transformers.LlamaForCausalLM.from_pretrained(
        folder("default"), config=copy.deepcopy(spec.hf_config), attn_implementation="sdpa"
    )
    assert_same_logits(ours, theirs.eval(), reset=False)  # HF's own attention, per document
    batch = make_batch(reset=True)
    with torch.no_grad():
        # transformers rounds RoPE angles in fp32, ours are exact: rounding apart, relative to
        # the logits' magnitude
        assert_close_scaled(spec.build().eval()(batch), ours.eval()(batch), rel=2e-5)


def test_model_hf_rope_theta_alone_keeps_the_checkpoint_scaling(folder):
    spec = HFModelSpec(path=folder("yarn"), config_overrides={"rope_theta": 1e6})
    assert spec.hf_config.rope_parameters["rope_type"] == "yarn"
    assert spec.hf_config.rope_parameters["rope_theta"] == 1e6
    assert (
        spec.build().hf_model.model.rotary_emb.inv_freq[-1]
        != hf_model("yarn").model.rotary_emb.inv_freq[-1]
    )


# --------------------------------------------------------------------------- config / presets
def test_from_name_overrides_theta_and_merges_scaling():
    config = LlamaConfig.from_name(
        "llama3_8b", rope_theta=8e6, rope_scaling={"type": "yarn", "factor": 16.0}
    )
    assert config.rope_theta == 8e6
    assert config.rope_scaling.type == "yarn" and config.rope_scaling.factor == 16.0
    assert config.rope_scaling.original_max_position == 8192  # the preset's
    kept = LlamaConfig.from_name("llama3_8b", rope_theta=None, rope_scaling=None)
    assert kept.rope_theta == 500000.0 and kept.rope_scaling.factor == 8.0


def test_composed_model_takes_rope_overrides(tmp_path):
    from helpers import compose
    from hydra.utils import instantiate

    cfg = compose(
        [
            "model=llama3_8b",
            "model.rope_theta=8e6",
            "model.rope_scaling={type: linear, factor: 2}",
        ],
        output_dir=tmp_path,
    )
    config = instantiate(cfg.model)
    assert config.rope_theta == 8e6 and config.rope_scaling.type == "linear"
    assert config.rope_scaling.factor == 2


def test_default_model_keeps_the_presets_whole_row_loss_chunk(tmp_path):
    from helpers import compose
    from hydra.utils import instantiate

    config = instantiate(compose([], output_dir=tmp_path).model)
    assert config.loss_chunk_size == PRESETS["tiny"]["loss_chunk_size"] == 131072


YARN = {"type": "yarn", "original_max_position": 64}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"type": "ntk"}, "rope_scaling.type='ntk' is unknown; expected one of"),
        ({"factor": 1.0}, r"rope_scaling.factor=1.0; expected a factor > 1"),
        ({"type": "linear", "factor": 0.5}, r"rope_scaling.factor=0.5; expected a factor > 1"),
        ({**YARN, "beta_fast": 1.0, "beta_slow": 2.0}, "beta_fast=1.0 must be greater"),
        ({**YARN, "beta_slow": 0}, r"rope_scaling.beta_slow=0; expected a positive"),
        ({**YARN, "attention_factor": -1.0}, "attention_factor=-1.0; expected a positive"),
        ({**YARN, "truncate": "yes"}, "truncate='yes'; expected true or false"),
        ({"original_max_position": 0}, "original_max_position=0; expected a positive int"),
        ({"low_freq_factor": 2.0, "high_freq_factor": 1.0}, "high_freq_factor=1.0 must be greater"),
    ],
)
def test_bad_rope_scaling_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_name("tiny", rope_scaling=fields)


@pytest.mark.parametrize("theta", [0, -1.0])
def test_bad_rope_theta_is_named(theta, folder):
    with pytest.raises(ValueError, match=f"rope_theta={theta}; expected a positive number"):
        LlamaConfig.from_name("tiny", rope_theta=theta)
    with pytest.raises(ValueError, match=f"rope_theta={theta}; expected a positive number"):
        HFModelSpec(path=folder("default"), config_overrides={"rope_theta": theta})


def test_model_hf_bad_rope_overrides_are_named(folder):
    bad = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.5}}
    with pytest.raises(ValueError, match="beta_fast=0.5 must be greater"):
        HFModelSpec(path=folder("default"), config_overrides=bad)
    with pytest.raises(ValueError, match=r"RoPE type 'yarn' needs \['factor'\]"):
        HFModelSpec(path=folder("default"), config_overrides={"rope_scaling": {"type": "yarn"}})
    with pytest.raises(ValueError, match="unsupported RoPE type 'dynamic'"):
        HFModelSpec(
            path=folder("default"),
            config_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        )
