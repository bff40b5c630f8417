"""Training FLOPs of one packed batch, with attention counted only inside documents."""

from __future__ import annotations

from torch import Tensor

from longctx.model.settings import LlamaSettings


def estimate_flops(config: LlamaSettings, seq_lens: Tensor) -> float:
    """Forward + backward FLOPs of longctx's Llama on a batch (see :func:`training_flops`)."""
    return training_flops(
        matmul_params(config), config.head_dim, config.n_heads, config.n_layers, seq_lens
    )


def training_flops(
    matmul_params: int, head_dim: int, n_heads: int, n_layers: int, seq_lens: Tensor
) -> float:
    """The one formula: forward + backward (3x forward) FLOPs of a batch with per-row segment
    lengths ``seq_lens`` [B, S] (zero padded).

    Dense: 2 FLOPs per multiply-add, 6 * (parameters multiplied per token) per token.
    Attention: a causal segment of n tokens has n^2 / 2 query-key pairs; per pair and head,
    QK^T and PV each cost 2 * head_dim FLOPs forward; x3 for forward + backward; per layer.
    """
    lens = seq_lens.double()
    if (lens < 0).any():
        raise ValueError(f"seq_lens has negative lengths: {seq_lens.tolist()}")
    pairs = float((lens**2).sum()) / 2
    attention = 3.0 * pairs * 2 * (2 * head_dim) * n_heads * n_layers
    return 6.0 * matmul_params * float(lens.sum()) + attention


def matmul_params(config: LlamaSettings) -> int:
    """Parameters touched per token: everything but the input embedding table, plus the lm
    head (which a tied model shares with the embedding, but still multiplies by)."""
    embedding = config.vocab_size * config.dim
    tables = embedding if config.tie_embeddings else 2 * embedding
    return config.num_params() - tables + embedding
