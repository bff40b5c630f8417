"""Hugging Face Llama folders, without importing transformers: the name and config mapping,
and the writer (:func:`save_hf`); longctx.hf.weight_source reads them (``load_hf``, init_from).

A local folder holds config.json and either model.safetensors or shards listed by
model.safetensors.index.json. Both config styles are read: transformers 4.x (top-level
``rope_theta`` and ``rope_scaling``) and 5.x (``rope_parameters`` holding both). Weights keep
HF's layout: its q/k projections use the same rotate-half RoPE as longctx, so no permutation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from longctx.errors import LongctxError
from longctx.hf.folders import CONFIG_FILE
from longctx.model.config import LlamaConfig
from longctx.model.rope import RopeScaling

INDEX_FILE = "model.safetensors.index.json"

# longctx parameter name -> HF name; "{i}" is the layer index
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, index, rest = name.split(".", 2)  # layers.{i}.<rest>
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> LlamaConfig:
    """LlamaConfig from a parsed HF config.json; ``overrides`` are LlamaConfig fields
    (:meth:`LlamaConfig.from_fields`)."""
    _check_hf_llama(hf)
    max_position = hf.get("max_position_embeddings", 2048)
    rope = hf.get("rope_parameters") or {}  # 5.x; 4.x has top-level rope_theta and rope_scaling
    fields = dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=RopeScaling.from_hf(rope or hf.get("rope_scaling") or {}, max_position),
        max_seq_len=max_position,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    return LlamaConfig.from_fields(fields, **overrides)


def _check_hf_llama(hf: dict[str, Any]) -> None:
    """Refuse an HF config that is not a Llama longctx's model can hold (another model type,
    activation, biases, a head_dim of its own), naming every difference."""
    problems = []
    if hf.get("model_type", "llama") != "llama":
        problems.append(f"model_type={hf.get('model_type')!r} (expected 'llama')")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf.get('hidden_act')!r} (expected 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=True (longctx's Llama has no biases)")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        problems.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if problems:
        raise LongctxError("unsupported HF Llama config: " + "; ".join(problems))


def config_to_hf(config: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """A config.json for LlamaForCausalLM. Written in the 4.x style (top-level rope_theta,
    rope_scaling), which transformers 5.x still reads and converts."""
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": None,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if config.rope_scaling is not None:
        scaling = config.rope_scaling.to_hf()
        out["rope_scaling"] = {
            k: float(v) if k in _FLOAT_ROPE_KEYS else v for k, v in scaling.items()
        }
    return out


# rope_scaling fields transformers 4.x validates as floats (an int factor from a YAML `4` warns)
_FLOAT_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
)


def save_hf(
    model,
    path: str | Path,
    max_shard_size: str | int = "5GB",
    on_bytes: Callable[[int], None] | None = None,
    **config_extra: Any,
) -> None:
    """config.json (plus ``config_extra`` keys) and safetensors with HF names (lm_head omitted
    when tied): model.safetensors, or shards and their index above ``max_shard_size``.
    ``on_bytes(n)`` is called after each shard with its size (a progress bar's update)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        to_hf_name(name): t.detach().cpu().contiguous() for name, t in model.state_dict().items()
    }
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # the embedding itself; tie_word_embeddings says so
    dtype = next(iter(state.values())).dtype
    hf_config = {**config_to_hf(model.config, dtype), **config_extra}
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {n: state[n] for n in names}
        save_file(shard, path / filename, metadata={"format": "pt"})
        if on_bytes is not None:
            on_bytes(sum(t.numel() * t.element_size() for t in shard.values()))
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
