"""The `flash` backend: a varlen flash-attention kernel over the flattened B*L tokens.

Two implementations of the same computation, both driven by ``cu_seqlens``/``max_seqlen``:
``flash_attn.flash_attn_varlen_func`` (the flash-attn package) and PyTorch's own
``torch.nn.attention.varlen.varlen_attn`` (same kernel family, shipped with recent CUDA
builds of torch). flash-attn is preferred when importable; both are CUDA-only, fp16/bf16-only.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard, piece_spans, span_index
from longctx.errors import LongctxError
from longctx.model.attention.base import AttentionBackend
from longctx.model.attention.names import FLASH

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def torch_varlen_attn():
    """torch.nn.attention.varlen.varlen_attn, or None when this torch has no such function."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def available_flash_impls(device: torch.device) -> tuple[str, ...]:
    """Implementations of the flash backend that can run on ``device``, preferred first."""
    if device.type != "cuda":
        return ()
    impls = ("flash_attn",) if flash_attn_importable() else ()
    return impls + (("torch_varlen",) if torch_varlen_attn() is not None else ())


def flash_varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, impl: str
) -> Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D]; one causal sequence per segment."""
    b, length, h, d = q.shape
    out_THD = flash_varlen(
        q.reshape(b * length, h, d),  # T = B*L flat tokens, the layout cu_seqlens indexes
        k.reshape(b * length, k.shape[2], d),
        v.reshape(b * length, k.shape[2], d),
        (cu_seqlens, cu_seqlens),
        (max_seqlen, max_seqlen),
        impl,
    )
    return out_THD.view(b, length, h, d)


def flash_varlen(
    q_THD: Tensor,
    k_SHD: Tensor,
    v_SHD: Tensor,
    cu_seqlens_qk: tuple[Tensor, Tensor],
    max_seqlen_qk: tuple[int, int],
    impl: str,
) -> Tensor:
    """Sequence i: queries cu_q[i]:cu_q[i+1] of q, keys cu_k[i]:cu_k[i+1] of k/v, causal.

    Where a sequence has more keys than queries, the causal mask is aligned bottom-right (the
    queries are the last keys), as flash-attn >= 2.1 does: context parallelism relies on it.
    """
    if impl == "flash_attn":
        return _flash_attn_call(q_THD, k_SHD, v_SHD, cu_seqlens_qk, max_seqlen_qk)
    if impl == "torch_varlen":
        return _torch_varlen_call(q_THD, k_SHD, v_SHD, cu_seqlens_qk, max_seqlen_qk)
    raise ValueError(
        f"unknown flash implementation {impl!r}; expected 'flash_attn' or 'torch_varlen'"
    )


def _flash_attn_call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_qk, max_seqlen_qk):
    from flash_attn import flash_attn_varlen_func  # lazy: optional GPU dependency

    # GQA is native: k/v may have fewer heads
    return flash_attn_varlen_func(q, k, v, *cu_seqlens_qk, *max_seqlen_qk, causal=True)


def _torch_varlen_call(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_qk, max_seqlen_qk):
    """torch's varlen_attn; its causal/GQA arguments changed across releases, so ask it."""
    fn = torch_varlen_attn()
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}  # (left, right) = (unbounded, 0): causal
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    else:
        raise RuntimeError(f"torch varlen_attn{inspect.signature(fn)} has no causal option")
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif n_rep > 1:
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return fn(q, k, v, *cu_seqlens_qk, *max_seqlen_qk, **kwargs)


@dataclasses.dataclass(frozen=True)
class FlashMetadata:
    """cu_seqlens int32 [num_segments + 1] over the flattened queries; for a ContextShard the
    packed key spans of its pieces over the gathered rows (key_index, cu_seqlens_k)."""

    impl: str  # "flash_attn" or "torch_varlen"
    cu_seqlens: Tensor
    max_seqlen: int
    key_index: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    max_seqlen_k: int = 0


class FlashBackend(AttentionBackend):
    """Varlen flash kernels. Context parallel: separate query and key cu_seqlens, the keys of
    each piece being its document's span of the gathered row (causal mask bottom-right)."""

    name = FLASH
    per_rank_key_spans = True

    def check_device(self, device: torch.device) -> None:
        if not available_flash_impls(device):
            raise RuntimeError(
                "attn_backend='flash' needs a CUDA device and the flash-attn package "
                f"(pip install -e '.[gpu]') or a torch with torch.nn.attention.varlen; "
                f"this device is {device}"
            )

    def check(self, device, seq_len, *, chunks=1, training=False) -> None:
        self.check_device(device)

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype not in FLASH_DTYPES:
            raise LongctxError(
                f"attn_backend='flash' does not support dtype {dtype}; flash kernels take "
                f"{FLASH_DTYPES} (use bf16 autocast/weights, or attn_backend='flex'/'sdpa' for "
                "fp32)"
            )

    def metadata(self, batch: PackedBatch) -> FlashMetadata:
        device = batch.tokens.device
        impl = available_flash_impls(device)[0]
        keys = context_key_spans(batch) if isinstance(batch, ContextShard) else {}
        return FlashMetadata(impl, batch.cu_seqlens.to(device), batch.max_seqlen, **keys)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, data: FlashMetadata) -> Tensor:
        return flash_varlen_attention(q, k, v, data.cu_seqlens, data.max_seqlen, data.impl)

    def attend_row(self, q, k, v, k_row, v_row, data: FlashMetadata) -> Tensor:
        b, length, h, d = q.shape
        k_pieces, v_pieces = (
            x.reshape(-1, *x.shape[2:]).index_select(0, data.key_index) for x in (k_row, v_row)
        )
        out_THD = flash_varlen(
            q.reshape(b * length, h, d),
            k_pieces,
            v_pieces,
            (data.cu_seqlens, data.cu_seqlens_k),
            (data.max_seqlen, data.max_seqlen_k),
            data.impl,
        )
        return out_THD.view(b, length, h, d)


def context_key_spans(shard: ContextShard) -> dict:
    """key_index (flat indices into the gathered rows), cu_seqlens_k and max_seqlen_k of the
    packed key spans of every piece of ``shard``."""
    spans = piece_spans(shard)
    key_lens = torch.tensor([s[3] for s in spans], dtype=torch.int32)
    device = shard.tokens.device
    return {
        "key_index": span_index([(s[2], s[3]) for s in spans]).to(device),
        "cu_seqlens_k": F.pad(key_lens.cumsum(0, dtype=torch.int32), (1, 0)).to(device),
        "max_seqlen_k": int(key_lens.max()),
    }
