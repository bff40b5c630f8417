"""Training FLOPs of one packed batch, with attention counted only inside documents."""

from __future__ import annotations

from torch import Tensor

from longctx.model.config import LlamaConfig


def estimate_flops(config: LlamaConfig, seq_lens: Tensor) -> float:
    """Forward + backward (3x forward) FLOPs of a batch with per-row segment lengths
    ``seq_lens`` [B, S] (zero padded).

    Dense: 2 FLOPs per multiply-add, 6 * (non-embedding params + lm head) per token.
    Attention: a causal segment of n tokens has n^2 / 2 query-key pairs; per pair and head,
    QK^T and PV each cost 2 * head_dim FLOPs forward; x3 for forward + backward; per layer.
    """
    lens = seq_lens.double()
    if (lens < 0).any():
        raise ValueError(f"seq_lens has negative lengths: {seq_lens.tolist()}")
    tokens = float(lens.sum())
    return 6.0 * matmul_params(config) * tokens + attention_flops(config, lens)


def matmul_params(config: LlamaConfig) -> int:
    """Parameters touched per token: everything but the input embedding table, plus the lm
    head (which a tied model shares with the embedding, but still multiplies by)."""
    embedding = config.vocab_size * config.dim
    tables = embedding if config.tie_embeddings else 2 * embedding
    return config.num_params() - tables + embedding


def attention_flops(config: LlamaConfig, lens: Tensor) -> float:
    pairs = float((lens**2).sum()) / 2
    per_layer_fwd = pairs * 2 * (2 * config.head_dim) * config.n_heads
    return 3.0 * per_layer_fwd * config.n_layers
