"""Llama as a pure nn.Module over PackedBatch: document-masked attention, position-id RoPE.

No Lightning, no Hydra: typed LlamaSettings (a LlamaConfig) in, logits or a chunked loss out.
Everything the layers share is derived from the batch once per forward: the attention metadata
(segment boundaries in the backend's format) and the RoPE cos/sin of every token's position id.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import skip_init
from torch.utils.checkpoint import checkpoint

from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard, gather_row, own_tokens
from longctx.errors import LongctxError
from longctx.model.attention import (
    AttentionMetadata,
    attention,
    attention_over_row,
    build_attention_metadata,
    resolve_backend,
)
from longctx.model.attention.cached import KVCache, cached_attention
from longctx.model.flops import estimate_flops
from longctx.model.interface import PackedCausalLM, check_batch
from longctx.model.rope import apply_rope, inv_frequencies, rope_cos_sin
from longctx.model.settings import LlamaSettings


def _linear(in_features: int, out_features: int) -> nn.Linear:
    """An uninitialised bias-free Linear on the current default device: reset_parameters
    alone draws from the RNG, so Llama(config) after manual_seed(s) is reproducible."""
    device = torch.get_default_device()
    return skip_init(nn.Linear, in_features, out_features, bias=False, device=device)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in fp32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)).to(x.dtype), the Hugging Face Llama formula, with its own backward.

    Autograd through the formula makes about ten passes over [tokens, dim] in backward and
    saves the normalised x; this backward makes four, two of them matrix-vector products, and
    keeps only x and the per-token 1/rms (measured on CPU at 16k x 256: 28 -> 11 ms forward
    plus backward, nine norms per step of the tiny model). At least fp32 throughout.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x32 = x.to(_at_least_fp32(x.dtype))
        mean_square = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_() / x.shape[-1]
        inv_rms = mean_square.add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, inv_rms)
        return weight * (x32 * inv_rms).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, inv_rms = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):  # the products below stay fp32
            dtype = _at_least_fp32(x.dtype)
            x32, grad32, w32 = x.to(dtype), grad.to(dtype), weight.to(dtype)
            grad_x_ND = (grad32 * x32).flatten(0, -2)  # N = tokens
            grad_weight = inv_rms.flatten() @ grad_x_ND  # sum over tokens of grad * x / rms
            # d/dx of x * r with r = rsqrt(mean(x^2) + eps): r (grad * w) - x r^3 mean(grad * w * x)
            coef = (grad_x_ND @ w32).view_as(inv_rms) * inv_rms.pow(3) / -x.shape[-1]
            grad_in = (grad32 * w32).mul_(inv_rms).addcmul_(x32, coef)
        return grad_in.to(x.dtype), grad_weight.to(weight.dtype), None


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class Attention(nn.Module):
    def __init__(self, config: LlamaSettings):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.wq = _linear(config.dim, config.n_heads * config.head_dim)
        self.wk = _linear(config.dim, config.n_kv_heads * config.head_dim)
        self.wv = _linear(config.dim, config.n_kv_heads * config.head_dim)
        self.wo = _linear(config.n_heads * config.head_dim, config.dim)

    def forward(
        self,
        x_BLD: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata | None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        """Training and evaluation: ``cache`` None. With a cache, the keys and values are kept
        in it as layer ``layer``'s (prefill: ``meta`` given) or the queries attend to it
        (decoding: ``meta`` None)."""
        q_BLHD, k_BLKD, v_BLKD = self.project(x_BLD, cos, sin)
        if cache is None:
            out_BLHD = attention(q_BLHD, k_BLKD, v_BLKD, meta)
        else:
            out_BLHD = cached_step(q_BLHD, k_BLKD, v_BLKD, meta, cache, layer)
        return self.wo(out_BLHD.flatten(2))

    def project(self, x_BLD: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, L, H, D] and k, v [B, L, Hkv, D], RoPE applied to q and k."""
        b, length, _ = x_BLD.shape
        q_BLHD = self.wq(x_BLD).view(b, length, self.n_heads, self.head_dim)
        k_BLKD = self.wk(x_BLD).view(b, length, self.n_kv_heads, self.head_dim)
        v_BLKD = self.wv(x_BLD).view(b, length, self.n_kv_heads, self.head_dim)
        return apply_rope(q_BLHD, cos, sin), apply_rope(k_BLKD, cos, sin), v_BLKD


def cached_step(q, k, v, meta: AttentionMetadata | None, cache: KVCache, layer: int) -> Tensor:
    """Attention that keeps the keys and values: a prefill through the normal attention when
    ``meta`` is given (a context-parallel shard caches its whole rows' keys, gathered as its
    attention gathers them), else a decoding step against the cache."""
    if meta is None:
        k_all, v_all = cache.extend(layer, k, v)
        return cached_attention(q, k_all, v_all, cache.key_start)
    if meta.shard is None:
        cache.extend(layer, k, v)
        return attention(q, k, v, meta)
    k_row, v_row = (gather_row(x, meta.shard) for x in (k, v))
    cache.extend(layer, k_row, v_row)
    k_own, v_own = (own_tokens(x, meta.shard) for x in (k_row, v_row))
    return attention_over_row(q, k_own, v_own, k_row, v_row, meta)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: LlamaSettings):
        super().__init__()
        self.w1 = _linear(config.dim, config.ffn_dim)  # gate
        self.w2 = _linear(config.ffn_dim, config.dim)  # down
        self.w3 = _linear(config.dim, config.ffn_dim)  # up

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaSettings):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> Tensor:
        h = h + self.attention(self.attention_norm(h), cos, sin, meta, cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(PackedCausalLM):
    def __init__(self, config: LlamaSettings):
        super().__init__()
        self.config = config
        self.tok_embeddings = skip_init(
            nn.Embedding, config.vocab_size, config.dim, device=torch.get_default_device()
        )
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # tied: the output projection is tok_embeddings.weight (see output_weight)
        self.output = None if config.tie_embeddings else _linear(config.dim, config.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(0, init_std) weights, unit norms; residual-branch outputs (wo, w2) scaled by
        1/sqrt(2 n_layers) so the residual stream's variance does not grow with depth."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear | nn.Embedding):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, 0.0, out_std if last in ("wo", "w2") else std)

    @property
    def output_weight(self) -> Tensor:
        """[V, dim] projection from hidden states to logits."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden_states(self, batch: PackedBatch) -> Tensor:
        """Final-normed hidden states [B, L, dim]."""
        self._check_batch(batch)
        device = self.tok_embeddings.weight.device
        meta = build_attention_metadata(batch, resolve_backend(self.config.attn_backend, device))
        h_BLD = self.tok_embeddings(batch.tokens)
        cos, sin = self._rope(batch.position_ids, h_BLD.dtype)
        checkpointing = self.config.activation_checkpointing and self.training
        for layer in self.layers:
            if checkpointing:
                h_BLD = checkpoint(layer, h_BLD, cos, sin, meta, use_reentrant=False)
            else:
                h_BLD = layer(h_BLD, cos, sin, meta)
        return self.norm(h_BLD)

    @property
    def loss_chunk_size(self) -> int:
        return self.config.loss_chunk_size

    def estimate_flops(self, seq_lens: Tensor) -> float:
        return estimate_flops(self.config, seq_lens)

    @torch.no_grad()
    def prefill(self, batch: PackedBatch, capacity: int) -> tuple[Tensor, KVCache]:
        """(logits [B, V] after each row's last token, the cache of the rows' keys and values
        with room for ``capacity`` positions). The rows run through the normal attention path
        (their packing, position ids, backend; a ContextShard under context parallelism); what
        is generated next continues each row's last segment."""
        self._check_batch(batch)
        device = self.tok_embeddings.weight.device
        meta = build_attention_metadata(batch, resolve_backend(self.config.attn_backend, device))
        cache = KVCache(self.config.n_layers, capacity)
        h_BLD = self.tok_embeddings(batch.tokens)
        cos, sin = self._rope(batch.position_ids, h_BLD.dtype)
        for i, layer in enumerate(self.layers):
            h_BLD = layer(h_BLD, cos, sin, meta, cache, i)
        position_ids, seq_lens = batch.position_ids, batch.seq_lens
        if isinstance(batch, ContextShard):  # the row's last token may live on another rank
            h_BLD, position_ids = gather_row(h_BLD, batch), gather_row(position_ids, batch)
            seq_lens = batch.row_seq_lens
        last_segment = seq_lens.gather(1, (seq_lens > 0).sum(1, keepdim=True) - 1).squeeze(1)
        cache.key_start = (position_ids.shape[1] - last_segment).long()
        cache.next_position = position_ids[:, -1] + 1
        cache.length = position_ids.shape[1]
        return F.linear(self.norm(h_BLD[:, -1]), self.output_weight), cache

    @torch.no_grad()
    def decode(self, tokens_BT: Tensor, cache: KVCache) -> Tensor:
        """Logits [B, T, V] of T new tokens appended to the cached rows (their keys and values
        are added to ``cache``)."""
        position_ids = cache.positions(tokens_BT.shape[1])
        limit = self.config.max_seq_len
        if int(position_ids.max()) >= limit:
            raise LongctxError(
                f"decoding reaches position {int(position_ids.max())}; the model's positions end "
                f"at max_seq_len={limit}: generate fewer tokens or use a shorter prompt"
            )
        h_BTD = self.tok_embeddings(tokens_BT)
        cos, sin = self._rope(position_ids, h_BTD.dtype)
        for i, layer in enumerate(self.layers):
            h_BTD = layer(h_BTD, cos, sin, None, cache, i)
        cache.advance(tokens_BT.shape[1])
        return F.linear(self.norm(h_BTD), self.output_weight)

    def _rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        c = self.config
        inv_freq = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, position_ids.device)
        scale = 1.0 if c.rope_scaling is None else c.rope_scaling.attention_scale
        return rope_cos_sin(inv_freq, position_ids, dtype, scale, c.exact_rope_angles)

    def _check_batch(self, batch: PackedBatch) -> None:
        self.config.check_seq_len(batch.row_len)
        device = self.tok_embeddings.weight.device
        check_batch(batch, device, self.config.vocab_size, self.config.max_seq_len)
