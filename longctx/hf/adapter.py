"""Any Hugging Face causal LM, trained on PackedBatch with documents masked.

transformers masks packed documents only when position ids reset (and only with its cache off);
with continuous positions its own attention runs across document boundaries. Here the HF model's
attention layers call a function registered with ``transformers.AttentionInterface`` as
"longctx", which runs longctx's backends (per-document sdpa on CPU, flash varlen or flex on GPU)
on the PackedBatch's AttentionMetadata, handed through the model's forward keyword arguments.
Positions come from the batch (reset or continuous); the loss is longctx's chunked
cross-entropy over the base model's hidden states, so full logits are never materialised.

Refused, with an error naming the architecture: families whose layers are not all softmax
attention (recurrent, linear-attention or convolution state would carry across documents),
attention logit soft-capping, final-logit soft-capping, an lm head with a bias, and a sliding
window shorter than a document (the longctx backends implement no window; a window at least as
long as every document changes nothing, so it is checked per batch).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from longctx.batch import PackedBatch
from longctx.dtypes import dtype_named
from longctx.errors import LongctxError
from longctx.hf.folders import CONFIG_FILE, LOCAL_ONLY, check_no_remote_code, check_override_names
from longctx.model.attention import (
    AttentionMetadata,
    attention,
    build_attention_metadata,
    resolve_backend,
)
from longctx.model.attention.names import check_backend_name
from longctx.model.flops import training_flops
from longctx.model.interface import PackedCausalLM, check_batch, check_weights
from longctx.model.rope import RopeScaling
from longctx.model.validation import require_positive

ATTN_IMPLEMENTATION = "longctx"
# model_type values whose layers keep a recurrent / linear-attention / convolution state that
# would flow from one packed document into the next (checked before any weight is read)
STATEFUL_MODEL_TYPES = frozenset(
    {
        "mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "xlstm", "qwen3_next", "qwen3_5",
        "qwen3_5_moe", "recurrent_gemma", "zamba", "zamba2", "bamba", "granitemoehybrid",
        "lfm2", "lfm2_moe", "lfm2_vl", "falcon_h1", "nemotron_h", "minimax", "olmo_hybrid",
        "kimi_linear", "plamo2",
    }
)  # fmt: skip
SOFTMAX_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class UnsupportedModelError(LongctxError):
    """An HF model longctx cannot train on packed documents without leaking across them."""


def _describe(config) -> str:
    arch = ", ".join(getattr(config, "architectures", None) or [])
    model_type = f"model_type={getattr(config, 'model_type', '?')!r}"
    return f"{arch} ({model_type})" if arch else model_type


def check_supported(config) -> None:
    """Raise UnsupportedModelError unless every layer is softmax attention longctx can mask."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = _describe(config)
    if {config.model_type, text.model_type} & STATEFUL_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} has recurrent / linear-attention / convolution layers: their state would "
            "carry from one packed document into the next; longctx trains only models whose "
            "layers are all softmax attention"
        )
    other = set(getattr(text, "layer_types", None) or []) - SOFTMAX_LAYER_TYPES
    if other:
        raise UnsupportedModelError(
            f"{name} has layer types {sorted(other)}; longctx trains only "
            f"{sorted(SOFTMAX_LAYER_TYPES)} layers (anything else may leak state across documents)"
        )
    for attr in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, attr, None):
            raise UnsupportedModelError(
                f"{name} sets {attr}={getattr(text, attr)}; longctx's attention backends and "
                "chunked loss do not implement soft-capping"
            )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder; expected a causal LM")


def check_window(config, seq_len: int) -> None:
    """A sliding window shorter than a possible document would need a windowed backend."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return  # e.g. Qwen2 keeps sliding_window set but every layer is full attention
    if getattr(text, "use_sliding_window", True) is False:
        return
    if window is not None and seq_len > window:
        raise UnsupportedModelError(
            f"{_describe(config)} uses sliding-window attention (window {window}) and data.seq_len="
            f"{seq_len} allows longer documents; longctx's backends implement no window. Use "
            f"seq_len <= {window}, or, if the checkpoint's window is unused, "
            "model.config_overrides.sliding_window=null"
        )


@dataclasses.dataclass
class AttentionContext:
    """What every attention layer gets for one forward: the metadata, and a call count that
    proves the HF model's layers really dispatched to the longctx function."""

    meta: AttentionMetadata
    max_segment_len: int
    calls: int = 0


def longctx_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    longctx: AttentionContext | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention function: query [B, H, L, D], key/value [B, Hkv, L, D] in;
    output [B, L, H, D] and no weights out, documents masked by ``longctx.meta``."""
    _check_call(module, attention_mask, dropout, sliding_window, softcap, longctx, kwargs)
    q_BLHD = query.transpose(1, 2)
    head_dim = q_BLHD.shape[-1]
    if scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-12):
        # the backends scale by 1/sqrt(D); fold the model's own scale (Granite, Gemma) into q
        q_BLHD = q_BLHD * (scaling * math.sqrt(head_dim))
    out_BLHD = attention(q_BLHD, key.transpose(1, 2), value.transpose(1, 2), longctx.meta)
    longctx.calls += 1
    return out_BLHD, None


def _check_call(module, attention_mask, dropout, sliding_window, softcap, ctx, kwargs) -> None:
    if not isinstance(ctx, AttentionContext):
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} was called without PackedBatch metadata "
            "(the 'longctx' keyword argument); run the model through longctx.hf.HFCausalLM"
        )
    if attention_mask is not None:
        raise ValueError("longctx attention takes no attention_mask: documents come from the batch")
    if dropout:
        raise LongctxError(f"longctx attention implements no attention dropout; got {dropout}")
    if softcap or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(
            f"{type(module).__name__} uses attention soft-capping, sinks or a position bias, "
            "which longctx's backends do not implement"
        )
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise UnsupportedModelError(f"{type(module).__name__} is not causal attention")
    if sliding_window is not None and ctx.max_segment_len > sliding_window:
        raise UnsupportedModelError(
            f"{type(module).__name__} has a sliding window of {sliding_window} tokens but the "
            f"batch has a document of {ctx.max_segment_len}; longctx's backends implement no window"
        )


class HFCausalLM(PackedCausalLM):
    """An HF causal LM over PackedBatch, with the interface of longctx's Llama:
    forward(batch) -> logits, hidden_states, token_loss, loss -> (loss_sum, num_tokens)."""

    def __init__(self, hf_model: nn.Module, attn_backend: str, loss_chunk_size: int) -> None:
        """``hf_model`` as HFModelSpec.build loads it: its family and the options checked."""
        super().__init__()
        head = hf_model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise UnsupportedModelError(f"{_describe(hf_model.config)} has an lm head with a bias")
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.hf_model = hf_model
        self.attn_backend, self.loss_chunk_size = attn_backend, loss_chunk_size
        self.config = hf_model.config

    @property
    def output_weight(self) -> Tensor:
        """[V, dim] lm head with the family's logit scale folded in (Granite, Cohere)."""
        weight = self.hf_model.get_output_embeddings().weight
        scale = logit_scale(self.config)
        return weight if scale == 1.0 else weight * scale

    def hidden_states(self, batch: PackedBatch) -> Tensor:
        """Final-normed hidden states [B, L, dim] of the HF base model."""
        embeddings = self.hf_model.get_input_embeddings()
        check_batch(batch, embeddings.weight.device, embeddings.num_embeddings, None)
        device = batch.tokens.device
        meta = build_attention_metadata(batch, resolve_backend(self.attn_backend, device))
        ctx = AttentionContext(meta, batch.max_seqlen)
        out = self.hf_model.get_decoder()(
            input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False, longctx=ctx
        )
        self._check_dispatch(ctx)
        return out.last_hidden_state

    @torch.no_grad()
    def generate_from_batch(self, batch: PackedBatch, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation (one beam, no sampling, stopping at the model's EOS) of rows of
        one document each, the suite's prompts: transformers' own generate and KV cache, under
        its sdpa (or eager) attention, since generate's decode steps carry no PackedBatch for
        the longctx function, and one document per row needs no document mask."""
        if (batch.seq_lens[:, 1:] != 0).any():
            raise ValueError("HFCausalLM generates rows of one document each (no packed segments)")
        plain = "sdpa" if getattr(self.hf_model, "_supports_sdpa", False) else "eager"
        self.hf_model.set_attn_implementation(plain)
        try:
            return greedy_continuations(self.hf_model, batch.tokens, max_new_tokens)
        finally:
            self.hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)

    def estimate_flops(self, seq_lens: Tensor) -> float:
        """Forward + backward FLOPs: 6 x matmul parameters per token, attention within documents."""
        text, hf_model = self.config.get_text_config(), self.hf_model
        params = sum(p.numel() for p in hf_model.parameters())
        embed = hf_model.get_input_embeddings().weight.numel()
        tied = hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
        matmul = params - embed + (embed if tied else 0)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads, layers = text.num_attention_heads, text.num_hidden_layers
        return training_flops(matmul, head_dim, heads, layers, seq_lens)

    def _check_dispatch(self, ctx: AttentionContext) -> None:
        expected = self.config.get_text_config().num_hidden_layers
        if ctx.calls != expected:
            raise UnsupportedModelError(
                f"{_describe(self.config)}: {ctx.calls} of {expected} layers ran the longctx "
                "attention; the others ignore transformers' AttentionInterface and would attend "
                "across documents"
            )


def logit_scale(config) -> float:
    """Factor the family applies to lm-head outputs: Granite divides, Cohere multiplies."""
    text = config.get_text_config()
    scale = 1.0 / getattr(text, "logits_scaling", 1.0)
    return scale * getattr(text, "logit_scale", 1.0)


def load_hf_config(path: str | Path, **config_overrides):
    """AutoConfig of a local checkpoint folder (no code of its own: longctx.hf.folders);
    refuses families longctx cannot mask.

    ``rope_theta`` and ``rope_scaling`` (or ``rope_parameters``) overrides are applied by
    :func:`override_rope`, the others by :func:`override_fields`; none reaches AutoConfig, so
    none can be a loader option.
    """
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"model.path={str(path)!r} is not a folder with a {CONFIG_FILE}")
    check_no_remote_code(folder)
    check_override_names(config_overrides)
    rope = {k: config_overrides.pop(k) for k in ROPE_OVERRIDES if k in config_overrides}
    config = AutoConfig.from_pretrained(folder, **LOCAL_ONLY)
    override_fields(config, config_overrides)
    if rope:
        override_rope(config, **rope)
    check_supported(config)
    return config


def override_fields(config, overrides: dict) -> None:
    """Set config fields as AutoConfig's keyword arguments would (a dict merges into a nested
    config), refusing a name the config does not have (AutoConfig would ignore it silently)."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        if not hasattr(config, key):
            raise LongctxError(
                f"model.config_overrides.{key} is not a field of {type(config).__name__}; "
                "expected one of its config.json fields"
            )
        current = getattr(config, key)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            value = type(current)(**{**current.to_dict(), **value})
        setattr(config, key, value)


ROPE_OVERRIDES = ("rope_theta", "rope_scaling", "rope_parameters")


def override_rope(config, rope_theta=None, rope_scaling=None, rope_parameters=None) -> None:
    """Set the RoPE base and/or scaling of a loaded config, validated as longctx's RopeScaling.

    AutoConfig keywords would not do: transformers 5 ignores ``rope_theta`` when config.json
    has ``rope_parameters``, and a ``rope_scaling`` keyword drops the base. So the whole
    ``rope_parameters`` dict is rebuilt here: the new scaling (or the checkpoint's) and the
    new base (or the scaling dict's, or the checkpoint's).
    """
    if rope_scaling is not None and rope_parameters is not None:
        raise LongctxError("config_overrides: give rope_scaling or rope_parameters, not both")
    text = config.get_text_config()
    current = dict(text.rope_parameters or {})
    if text.nested_rope_parameter_keys(current):
        raise UnsupportedModelError(
            f"{_describe(config)} has RoPE parameters per layer type; longctx overrides only a "
            "single rope_parameters dict"
        )
    scaling = rope_scaling if rope_scaling is not None else rope_parameters
    new = dict(scaling) if scaling is not None else current
    if rope_theta is None:
        rope_theta = new.get("rope_theta") or current.get("rope_theta")
    require_positive("config_overrides.rope_theta", rope_theta)
    new["rope_theta"] = float(rope_theta)
    if scaling is not None:  # one validation: longctx's own (names the bad value)
        RopeScaling.from_hf(new, text.max_position_embeddings)
    text.rope_parameters = new
    text.standardize_rope_params()
    text.validate_rope()


@dataclasses.dataclass
class HFModelSpec:
    """The Hydra ``model=hf`` node: reads only config.json until called, so preflight is cheap.

    It answers what the app's preflight asks of a LlamaConfig (attn_backend, max_seq_len,
    vocab_size, num_params) and, called, builds the HFCausalLM (LongCtxModule's factory).
    """

    path: str
    attn_backend: str = "auto"
    loss_chunk_size: int = 4096
    activation_checkpointing: bool = False
    dtype: str = "float32"
    config_overrides: dict = dataclasses.field(default_factory=dict)

    # its attention is transformers' layer calling longctx's: it cannot take a row split over
    # ranks, and the planner models longctx's Llama only
    supports_context_parallel: ClassVar[bool] = False
    plans_capacity: ClassVar[bool] = False
    exports_to_hf: ClassVar[bool] = False  # its weights already are a transformers model

    def __post_init__(self) -> None:
        check_backend_name(self.attn_backend)
        if not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 1:
            raise LongctxError(f"loss_chunk_size={self.loss_chunk_size!r}; expected a positive int")
        dtype_named(self.dtype)  # fail now on a typo
        self.config_overrides = dict(self.config_overrides or {})
        _ = self.hf_config  # fail now on a missing folder or a refused family

    @cached_property
    def hf_config(self):
        return load_hf_config(self.path, **self.config_overrides)

    @property
    def init_from(self) -> None:
        """The weights are ``path``'s: there is no other checkpoint to start from."""
        return None

    @property
    def vocab_size(self) -> int:
        return self.hf_config.get_text_config().vocab_size

    @property
    def max_seq_len(self) -> int:
        text = self.hf_config.get_text_config()
        return getattr(text, "max_position_embeddings", None) or 2**31 - 1

    def num_params(self) -> int:
        """Parameter count from the config alone: the model built on the meta device."""
        return sum(p.numel() for p in self._meta_model().parameters())

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse a seq_len the model cannot mask correctly or was not configured for."""
        check_window(self.hf_config, seq_len)
        if seq_len > self.max_seq_len:
            raise LongctxError(
                f"L={seq_len} exceeds max_position_embeddings={self.max_seq_len} of "
                f"{_describe(self.hf_config)}; raise it (and the RoPE settings) with "
                "model.config_overrides if the model is meant to train longer"
            )

    def build_from(self, weights) -> HFCausalLM:
        """The model from ``path`` (its own non-persistent buffers, e.g. RoPE frequencies,
        as transformers computes them) holding ``weights``, checked first against the model
        built on the meta device from config.json alone."""
        empty = {f"hf_model.{k}": v for k, v in self._meta_model().state_dict().items()}
        check_weights(empty, weights)
        model = self.build()
        model.load_state_dict(weights, strict=True)
        return model

    def _meta_model(self) -> nn.Module:
        """The model built from config.json alone, nothing allocated."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config, trust_remote_code=False)

    def build(self) -> HFCausalLM:
        """AutoModelForCausalLM from the local folder (no downloads) wrapped as HFCausalLM."""
        from transformers import AttentionInterface, AutoModelForCausalLM

        AttentionInterface.register(ATTN_IMPLEMENTATION, longctx_attention)  # idempotent
        hf_model = AutoModelForCausalLM.from_pretrained(
            self.path,
            config=self.hf_config,
            attn_implementation=ATTN_IMPLEMENTATION,
            dtype=dtype_named(self.dtype),
            **LOCAL_ONLY,
        )
        if self.activation_checkpointing:
            hf_model.gradient_checkpointing_enable({"use_reentrant": False})
        return HFCausalLM(hf_model, self.attn_backend, self.loss_chunk_size)


def load_hf_causal_lm(path: str | Path, **options) -> HFCausalLM:
    """The HF causal LM in the local folder ``path`` as HFCausalLM; ``options`` are
    HFModelSpec's fields (attn_backend, loss_chunk_size, dtype, ...)."""
    return HFModelSpec(str(path), **options).build()


def greedy_continuations(hf_model, input_ids: Tensor, max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy ``generate`` (one beam, no sampling, stopping at the model's
    EOS) of ``max_new_tokens`` after each row of ``input_ids``: the new ids per row.

    Greedy means greedy whatever the folder's generation_config.json says: generate fills every
    setting left unset from ``hf_model.generation_config`` (a repetition_penalty, suppress_tokens,
    a min_length would change the predictions), so it runs with a config of only the eos/pad ids
    and the length, and the model's own is put back afterwards."""
    from transformers import GenerationConfig

    stored = hf_model.generation_config
    eos = stored.eos_token_id
    pad = stored.pad_token_id if stored.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    greedy = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                              eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    hf_model.generation_config = greedy
    try:
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=greedy,
        )
    finally:
        hf_model.generation_config = stored
    return out[:, input_ids.shape[1] :].tolist()
