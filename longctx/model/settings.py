"""A Llama's settings, validated on construction: every field of its config, and what the
module (longctx.model.llama) and the FLOP count read. The config Hydra builds, with named
presets and the model it builds, is longctx.model.config.LlamaConfig, which adds no field."""

from __future__ import annotations

import dataclasses

from longctx.errors import LongctxError
from longctx.model.attention.names import AUTO, check_backend_name
from longctx.model.rope import RopeScaling
from longctx.model.validation import require_positive, require_positive_int


@dataclasses.dataclass
class LlamaSettings:
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
            raise LongctxError(
                f"rope_scaling={self.rope_scaling!r}; expected a RopeScaling, a dict or None"
            )
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise LongctxError(f"init_from={self.init_from!r}; expected a path or None")

    def _check_sizes(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            require_positive_int(name, getattr(self, name))
        for name in ("max_seq_len", "loss_chunk_size"):
            require_positive_int(name, getattr(self, name))
        for name in ("norm_eps", "rope_theta", "init_std"):
            require_positive(name, getattr(self, name))

    def _check_heads(self) -> None:
        if self.dim % self.n_heads:
            raise LongctxError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise LongctxError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each KV head among n_heads / n_kv_heads heads)"
            )
        if self.head_dim % 2:
            raise LongctxError(
                f"head_dim = dim / n_heads = {self.head_dim} is odd; RoPE rotates pairs, "
                "so it must be even"
            )

    def check_seq_len(self, seq_len: int) -> None:
        """The one length limit: rows no longer than the RoPE range the model is built for."""
        if seq_len > self.max_seq_len:
            raise LongctxError(
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
