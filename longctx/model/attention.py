"""Document-masked causal attention over packed batches, behind one call signature.

Every backend computes the same thing: for q [B, L, H, D] and k, v [B, L, Hkv, D], each token
attends causally to the tokens of its own segment of ``PackedBatch.seq_lens`` and to nothing
else, with softmax scale 1/sqrt(D). What a backend needs from the batch (cu_seqlens, a block
mask, document buckets, a dense mask) is derived once per forward by
``build_attention_metadata`` and shared by every layer.

- ``flash``: varlen flash kernel over the flattened tokens (CUDA; flash-attn, or torch's own
  varlen_attn when flash-attn is missing). See attention_flash.py.
- ``flex``: FlexAttention with a document block mask (compiled on CUDA; forward-only on CPU).
  See attention_flex.py.
- ``sdpa``: per-document SDPA, documents batched into length buckets, no L x L mask; the CPU
  training path. See attention_sdpa.py.
- ``eager``: explicit softmax(QK^T) under the dense [B, L, L] mask: the reference, small L.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from longctx.batch import DENSE_MASK_MAX_LEN, ContextShard, PackedBatch
from longctx.model.attention_flash import (
    FLASH_DTYPES,
    available_flash_impls,
    flash_attn_importable,
    flash_varlen,
    flash_varlen_attention,
)
from longctx.model.attention_sdpa import SdpaPlan, build_sdpa_plan, sdpa_attention
from longctx.model.context_parallel import (
    ContextMetadata,
    build_context_metadata,
    gather_row,
    splice_prefixed_pieces,
)

ATTENTION_BACKENDS = ("flash", "flex", "sdpa", "eager")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- resolution
def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map "auto" to the best backend for ``device``; check an explicit one can run there.

    auto: flash on CUDA with flash-attn installed, else flex on CUDA, else sdpa.
    """
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "flash" if flash_attn_importable() else "flex"
        return "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attn_backend={name!r}; expected one of {ATTENTION_BACKENDS + ('auto',)}"
        )
    if name == "flash" and not available_flash_impls(device):
        raise RuntimeError(
            "attn_backend='flash' needs a CUDA device and the flash-attn package "
            f"(pip install -e '.[gpu]') or a torch with torch.nn.attention.varlen; "
            f"this device is {device}"
        )
    return name


# --------------------------------------------------------------------------- metadata
@dataclasses.dataclass
class AttentionMetadata:
    """What one backend needs from a PackedBatch; built once per forward, shared by layers.

    Only the fields of ``backend`` are set. Shapes: cu_seqlens int32 [num_segments + 1] over
    the flattened B*L tokens; dense_mask bool [B, 1, L, L]. For a ContextShard, L is the local
    length L/N, segments are the shard's pieces, keys span the whole row (dense_mask
    [B, 1, L/N, row_len]) and ``context`` holds what the gathered keys need.
    """

    backend: str
    batch_size: int
    seq_len: int
    device: torch.device
    cu_seqlens: Tensor | None = None  # flash
    max_seqlen: int = 0  # flash
    flash_impl: str | None = None  # flash: "flash_attn" or "torch_varlen"
    block_mask: object | None = None  # flex: torch.nn.attention.flex_attention.BlockMask
    sdpa_plan: SdpaPlan | None = None  # sdpa: document buckets and their gather/scatter indices
    dense_mask: Tensor | None = None  # eager
    context: ContextMetadata | None = None  # context parallelism (a ContextShard)


def build_attention_metadata(batch: PackedBatch, backend: str) -> AttentionMetadata:
    """Derive what ``backend`` (already resolved, not "auto") needs from ``batch``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"build_attention_metadata got backend={backend!r}; expected a resolved backend, "
            f"one of {ATTENTION_BACKENDS} (call resolve_backend first)"
        )
    _check_batch_on_one_device(batch)
    b, length = batch.shape
    meta = AttentionMetadata(backend, b, length, batch.tokens.device)
    if isinstance(batch, ContextShard):
        meta.context = build_context_metadata(batch, backend)
    _METADATA_BUILDERS[backend](batch, meta)
    return meta


def _flash_metadata(batch: PackedBatch, meta: AttentionMetadata) -> None:
    impls = available_flash_impls(meta.device)
    if not impls:
        resolve_backend("flash", meta.device)  # raises the explanatory error
    meta.flash_impl = impls[0]
    meta.cu_seqlens = batch.cu_seqlens.to(meta.device)
    meta.max_seqlen = batch.max_seqlen


def _flex_metadata(batch: PackedBatch, meta: AttentionMetadata) -> None:
    from longctx.model.attention_flex import build_context_block_mask, build_document_block_mask

    key_len = meta.context.row_len if meta.context else meta.seq_len
    if meta.device.type == "cpu" and key_len > DENSE_MASK_MAX_LEN:
        raise ValueError(
            f"attn_backend='flex' on CPU runs uncompiled, which materialises the [B, H, L, L] "
            f"scores; it refuses L={key_len} > {DENSE_MASK_MAX_LEN}. Use 'sdpa' on CPU."
        )
    if meta.context:
        meta.block_mask = build_context_block_mask(batch)
    else:
        meta.block_mask = build_document_block_mask(batch)


def _sdpa_metadata(batch: PackedBatch, meta: AttentionMetadata) -> None:
    meta.sdpa_plan = build_sdpa_plan(batch)


def _eager_metadata(batch: PackedBatch, meta: AttentionMetadata) -> None:
    if meta.seq_len > DENSE_MASK_MAX_LEN:
        raise ValueError(
            f"attn_backend='eager' builds a dense [B, L, L] mask and refuses L={meta.seq_len} "
            f"> {DENSE_MASK_MAX_LEN}; use 'sdpa', 'flex' or 'flash' for long sequences"
        )
    meta.dense_mask = batch.to_dense_mask().unsqueeze(1)


_METADATA_BUILDERS = {
    "flash": _flash_metadata,
    "flex": _flex_metadata,
    "sdpa": _sdpa_metadata,
    "eager": _eager_metadata,
}


def _check_batch_on_one_device(batch: PackedBatch) -> None:
    devices = {t.device for t in (batch.tokens, batch.seq_lens, batch.position_ids)}
    if len(devices) != 1:
        raise ValueError(f"PackedBatch tensors are on several devices {devices}; move it whole")


# --------------------------------------------------------------------------- attention
# Under compile=true the blocks are compiled around this call, never through it: the metadata
# (bucket shapes, document spans) changes with every batch's layout, and tracing it would
# recompile every step. Each backend's kernel is fused already; flex compiles its own.
@torch.compiler.disable
def attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    """Document-causal attention. q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D] (q dtype)."""
    _check_qkv(q, k, v, meta)
    if meta.context is not None:
        return context_attention(q, k, v, meta)
    if meta.backend == "flash":
        return flash_varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, meta.flash_impl)
    if meta.backend == "flex":
        from longctx.model.attention_flex import flex_document_attention

        return flex_document_attention(q, k, v, meta.block_mask)
    if meta.backend == "sdpa":
        return sdpa_attention(q, k, v, meta.sdpa_plan)
    return eager_attention(q, k, v, meta.dense_mask)


def context_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    """Local queries [B, L/N, H, D] against the whole rows' keys, gathered from the group."""
    ctx = meta.context
    k_row, v_row = (gather_row(x, ctx.group, ctx.size, ctx.rounds) for x in (k, v))
    return attention_over_row(q, k, v, k_row, v_row, meta)


def attention_over_row(
    q: Tensor, k: Tensor, v: Tensor, k_row: Tensor, v_row: Tensor, meta: AttentionMetadata
) -> Tensor:
    """The shard's queries q [B, L/N, H, D] given its own keys k, v [B, L/N, Hkv, D] and the
    whole rows' keys k_row, v_row [B, L, Hkv, D]; the gather's consumer, separate for tests."""
    ctx = meta.context
    if meta.backend == "sdpa":  # local keys serve every piece whose document starts locally
        out = sdpa_attention(q, k, v, meta.sdpa_plan)
        return splice_prefixed_pieces(out, q, k_row, v_row, ctx)
    if meta.backend == "flash":
        b, length, h, d = q.shape
        k_pieces, v_pieces = (
            x.reshape(-1, *x.shape[2:]).index_select(0, ctx.key_index) for x in (k_row, v_row)
        )
        out_THD = flash_varlen(
            q.reshape(b * length, h, d),
            k_pieces,
            v_pieces,
            (meta.cu_seqlens, ctx.cu_seqlens_k),
            (meta.max_seqlen, ctx.max_seqlen_k),
            meta.flash_impl,
        )
        return out_THD.view(b, length, h, d)
    if meta.backend == "flex":
        from longctx.model.attention_flex import flex_document_attention

        return flex_document_attention(q, k_row, v_row, meta.block_mask)
    return eager_attention(q, k_row, v_row, meta.dense_mask)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, dense_mask_B1LL: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v under a dense mask, in fp32 or better: the reference."""
    n_rep = q.shape[2] // k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    q_BHLD = q.transpose(1, 2)
    k_BHLD = k.repeat_interleave(n_rep, dim=2).transpose(1, 2)  # query head h uses kv h // n_rep
    v_BHLD = v.repeat_interleave(n_rep, dim=2).transpose(1, 2)
    scores_BHLL = (q_BHLD.to(acc) @ k_BHLD.to(acc).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores_BHLL = scores_BHLL.masked_fill(~dense_mask_B1LL, float("-inf"))
    probs_BHLL = scores_BHLL.softmax(dim=-1)
    return (probs_BHLL @ v_BHLD.to(acc)).to(q.dtype).transpose(1, 2)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [B, L, H, D] and k, v [B, L, Hkv, D]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, length, h, d = q.shape
    if (b, length) != (meta.batch_size, meta.seq_len) or k.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must share [B, L] with the batch the "
            f"metadata was built for: B={meta.batch_size}, L={meta.seq_len}"
        )
    if k.shape[3] != d:
        raise ValueError(f"q head dim D={d} differs from the k/v head dim {k.shape[3]}")
    if h % k.shape[2] != 0:
        raise ValueError(f"q has H={h} heads, not a multiple of the k/v heads Hkv={k.shape[2]}")
    _check_dtype_and_device(q, k, v, meta)


def _check_dtype_and_device(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"attention got dtype {q.dtype}; expected one of {_FLOAT_DTYPES}")
    if meta.backend == "flash" and q.dtype not in FLASH_DTYPES:
        raise ValueError(
            f"attn_backend='flash' does not support dtype {q.dtype}; flash kernels take "
            f"{FLASH_DTYPES} (use bf16 autocast/weights, or attn_backend='flex'/'sdpa' for fp32)"
        )
    if not (q.device == k.device == v.device == meta.device):
        raise ValueError(
            f"q, k, v are on {q.device}, {k.device}, {v.device} but the attention metadata was "
            f"built for a batch on {meta.device}; move the batch to the model's device first"
        )
