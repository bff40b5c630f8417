"""Typed Llama configuration, validated on construction, with named presets."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from longctx.model.attention.names import AUTO, check_backend_name
from longctx.model.rope import RopeScaling
from longctx.model.validation import require_positive, require_positive_int


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 131072  # largest position RoPE is configured for
    # RoPE angles position * inv_freq in fp64 (exact) rather than fp32 (transformers' rounding)
    exact_rope_angles: bool = True
    tie_embeddings: bool = False
    attn_backend: str = AUTO
    activation_checkpointing: bool = False
    loss_chunk_size: int = 4096  # tokens per chunk of the chunked cross-entropy
    init_std: float = 0.02
    # weights to start from (a new stage: fresh optimizer, schedule and data position): a
    # transformers folder, or a longctx checkpoint / run folder (longctx.hf.weight_source)
    init_from: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # Hydra hands nested configs over as dicts
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self._check_sizes()
        self._check_heads()
        check_backend_name(self.attn_backend)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling={self.rope_scaling!r}; expected a RopeScaling, a dict or None"
            )
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise ValueError(f"init_from={self.init_from!r}; expected a path or None")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            require_positive_int(name, getattr(self, name))
        for name in ("max_seq_len", "loss_chunk_size"):
            require_positive_int(name, getattr(self, name))
        for name in ("norm_eps", "rope_theta", "init_std"):
            require_positive(name, getattr(self, name))

    def _check_heads(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each KV head among n_heads / n_kv_heads heads)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.head_dim} is odd; RoPE rotates pairs, "
                "so it must be even"
            )

    supports_context_parallel: ClassVar[bool] = True
    plans_capacity: ClassVar[bool] = True
    exports_to_hf: ClassVar[bool] = True

    def build(self):
        """Llama(self); on the meta device with ``init_from`` (configure_model shards it under
        FSDP2, materialises it and reads the weights, each rank its own shards)."""
        from longctx.model.llama import Llama

        if self.init_from:
            with torch.device("meta"):
                return Llama(self)
        return Llama(self)

    def build_from(self, weights):
        """Llama(self) holding ``weights``: built on the meta device, checked, then assigned
        (memory-mapped tensors stay mapped)."""
        from longctx.model.interface import check_weights
        from longctx.model.llama import Llama

        with torch.device("meta"):
            model = Llama(self)
        check_weights(model.state_dict(), weights)
        model.load_state_dict(weights, strict=True, assign=True)
        return model

    def check_seq_len(self, seq_len: int) -> None:
        """The one length limit: rows no longer than the RoPE range the model is built for."""
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"L={seq_len} > max_seq_len={self.max_seq_len}, the RoPE range the model is "
                "configured for"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Exact parameter count of ``Llama(self)`` (tied embeddings counted once)."""
        kv_dim = self.n_kv_heads * self.head_dim
        attn = 2 * self.dim * self.dim + 2 * self.dim * kv_dim  # wq, wo; wk, wv
        ffn = 3 * self.dim * self.ffn_dim  # w1, w2, w3
        per_layer = attn + ffn + 2 * self.dim  # + attention_norm, ffn_norm
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return embeddings + self.n_layers * per_layer + self.dim  # + final norm

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset ("tiny", "tiny_llama3", "llama3_1b", "llama3_8b") with field overrides (see
        :meth:`from_fields`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_fields(PRESETS[name], **overrides)

    @classmethod
    def from_fields(cls, base: dict[str, Any], **overrides: Any) -> LlamaConfig:
        """``base`` (a preset, a checkpoint's config) with field overrides.

        An override of None keeps the base value (Hydra's yaml spells "not overridden" so);
        a ``rope_scaling`` dict is merged into the base's (``{"factor": 16}`` keeps its type
        and original length).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(
                f"unknown LlamaConfig overrides {unknown}; fields are {sorted(fields)}"
            )
        merged = {**base, **{k: v for k, v in overrides.items() if v is not None}}
        if isinstance(overrides.get("rope_scaling"), dict):
            scaling = base.get("rope_scaling") or {}
            if dataclasses.is_dataclass(scaling):
                scaling = dataclasses.asdict(scaling)
            merged["rope_scaling"] = {**scaling, **overrides["rope_scaling"]}
        return cls(**merged)


# rope_scaling as a dict so that every config gets its own RopeScaling (from __post_init__).
PRESETS: dict[str, dict[str, Any]] = {
    # The CPU default: a few million parameters, byte-level vocabulary (256 bytes + specials).
    # With 512 logits per token a whole 128k-token row's fp32 logits are 256 MB: one loss
    # chunk, so the output projection is never recomputed.
    "tiny": dict(
        vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768,
        max_seq_len=131072, rope_theta=500000.0, loss_chunk_size=131072,
    ),
    # The tiny body with Llama 3's 128,256-id vocabulary (data.tokenizer=llama3): what the real
    # vocabulary costs on a CPU. Its two 128,256 x 256 tables are 66 M of its 69 M parameters;
    # a token's fp32 logits are 0.5 MB, so the loss runs in chunks of 1024 tokens (one chunk's logits, its
    # gradient and softmax: about 1.5 GB) whatever the row length.
    "tiny_llama3": dict(
        vocab_size=128256, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768,
        max_seq_len=131072, rope_theta=500000.0, loss_chunk_size=1024,
    ),
    # Llama 3.2 1B.
    "llama3_1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        rope_theta=500000.0, rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192),
        tie_embeddings=True, max_seq_len=131072,
    ),
    # Llama 3.1 8B.
    "llama3_8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192),
        tie_embeddings=False, max_seq_len=131072,
    ),
}  # fmt: skip
