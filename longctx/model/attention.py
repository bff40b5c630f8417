"""Document-masked causal attention over packed batches, behind one call signature.

Every backend computes the same thing: for q [B, L, H, D] and k, v [B, L, Hkv, D], each token
attends causally to the tokens of its own segment of ``PackedBatch.seq_lens`` and to nothing
else, with softmax scale 1/sqrt(D). What a backend needs from the batch (cu_seqlens, a block
mask, a dense mask, ...) is derived once per forward by ``build_attention_metadata`` and shared
by every layer.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from longctx.batch import DENSE_MASK_MAX_LEN, PackedBatch

ATTENTION_BACKENDS = ("flash", "flex", "sdpa", "eager")


# --------------------------------------------------------------------------- resolution
def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map "auto" to the best backend for ``device``; check an explicit one can run there."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            return "flash" if _flash_attn_importable() else "flex"
        return "sdpa"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attn_backend={name!r}; expected one of {ATTENTION_BACKENDS + ('auto',)}"
        )
    if name == "flash" and (device.type != "cuda" or not _flash_attn_importable()):
        raise RuntimeError(
            "attn_backend='flash' needs a CUDA device and the flash-attn package "
            f"(pip install -e '.[gpu]'); this device is {device}, flash_attn importable: "
            f"{_flash_attn_importable()}"
        )
    return name


def _flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- metadata
@dataclasses.dataclass
class AttentionMetadata:
    """What one backend needs from a PackedBatch; built once per forward, shared by layers."""

    backend: str
    batch_size: int
    seq_len: int
    device: torch.device
    # sdpa (simple form): python lists of per-row segment lengths
    row_seq_lens: list[list[int]] | None = None
    # eager: bool [B, 1, L, L], True where query i may attend to key j
    dense_mask: Tensor | None = None


def build_attention_metadata(batch: PackedBatch, backend: str) -> AttentionMetadata:
    """Derive what ``backend`` (already resolved, not "auto") needs from ``batch``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"build_attention_metadata got backend={backend!r}; expected a resolved backend, "
            f"one of {ATTENTION_BACKENDS} (call resolve_backend first)"
        )
    b, length = batch.shape
    meta = AttentionMetadata(backend, b, length, batch.tokens.device)
    if backend == "eager":
        if length > DENSE_MASK_MAX_LEN:
            raise ValueError(
                f"attn_backend='eager' builds a dense [B, L, L] mask and refuses L={length} "
                f"> {DENSE_MASK_MAX_LEN}; use 'sdpa', 'flex' or 'flash' for long sequences"
            )
        meta.dense_mask = batch.to_dense_mask().unsqueeze(1)
    elif backend == "sdpa":
        meta.row_seq_lens = [[n for n in row if n > 0] for row in batch.seq_lens.tolist()]
    else:
        raise NotImplementedError(f"attn_backend={backend!r} is not implemented yet")
    return meta


# --------------------------------------------------------------------------- attention
def attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    """Document-causal attention. q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D]."""
    _check_qkv(q, k, v, meta)
    if meta.backend == "eager":
        return _eager_attention(q, k, v, meta)
    if meta.backend == "sdpa":
        return _sdpa_loop_attention(q, k, v, meta)
    raise NotImplementedError(f"attn_backend={meta.backend!r} is not implemented yet")


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"attention expects q [B, L, H, D] and k, v [B, L, Hkv, D]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    b, length, h, d = q.shape
    bk, lk, hkv, dk = k.shape
    if (b, length) != (meta.batch_size, meta.seq_len) or (bk, lk) != (b, length):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share [B, L] with the batch the "
            f"metadata was built for: B={meta.batch_size}, L={meta.seq_len}"
        )
    if dk != d:
        raise ValueError(f"q head dim D={d} differs from k/v head dim {dk}")
    if h % hkv != 0:
        raise ValueError(f"q has H={h} heads, not a multiple of k/v's Hkv={hkv} heads")


def _repeat_kv(x_BLHD: Tensor, n_rep: int) -> Tensor:
    """[B, L, Hkv, D] -> [B, L, Hkv * n_rep, D]; query head h uses kv head h // n_rep."""
    return x_BLHD if n_rep == 1 else x_BLHD.repeat_interleave(n_rep, dim=2)


def _eager_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    n_rep = q.shape[2] // k.shape[2]
    q_BHLD = q.transpose(1, 2)
    k_BHLD = _repeat_kv(k, n_rep).transpose(1, 2)
    v_BHLD = _repeat_kv(v, n_rep).transpose(1, 2)
    scores_BHLL = (q_BHLD @ k_BHLD.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])
    scores_BHLL = scores_BHLL.masked_fill(~meta.dense_mask, float("-inf"))
    probs_BHLL = scores_BHLL.softmax(dim=-1).to(q.dtype)
    return (probs_BHLL @ v_BHLD).transpose(1, 2)


def _sdpa_loop_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    n_rep = q.shape[2] // k.shape[2]
    rows = []
    for b, lens in enumerate(meta.row_seq_lens):
        q_HLD = q[b].transpose(0, 1)
        k_HLD = _repeat_kv(k[b : b + 1], n_rep)[0].transpose(0, 1)
        v_HLD = _repeat_kv(v[b : b + 1], n_rep)[0].transpose(0, 1)
        outs, start = [], 0
        for n in lens:
            sl = slice(start, start + n)
            outs.append(
                F.scaled_dot_product_attention(
                    q_HLD[:, sl], k_HLD[:, sl], v_HLD[:, sl], is_causal=True
                )
            )
            start += n
        rows.append(torch.cat(outs, dim=1).transpose(0, 1))
    return torch.stack(rows)
