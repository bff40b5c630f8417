"""Document-masked causal attention over packed batches: one object per backend, one registry.

Every backend computes the same thing: for q [B, L, H, D] and k, v [B, L, Hkv, D], each token
attends causally to the tokens of its own segment of ``PackedBatch.seq_lens`` and to nothing
else, with softmax scale 1/sqrt(D). An :class:`AttentionBackend` (base.py) owns everything
about one backend: its capability checks (device, dtype, lengths), the metadata it derives from
a batch (once per forward, shared by every layer), its attend call, and its context-parallel
variant. Backends: flash.py, flex.py, sdpa.py and ``eager`` here (the dense [B, L, L] mask: the
reference, small L); names and "auto": names.py; decoding against a KV cache: cached.py.

Under context parallelism a ContextShard's local queries attend to the whole rows' keys,
gathered from the group (:mod:`longctx.context_shard`); its local tokens are cut into pieces,
each seeing its own tokens (causal) and the ``key_prefix_lens`` earlier tokens of its segment
(each backend's way: docs/context-parallel-balance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from longctx.batch import PackedBatch, check_dense_mask_len
from longctx.context_shard import ContextShard, gather_row, own_tokens
from longctx.model.attention.base import AttentionBackend
from longctx.model.attention.names import (
    ATTENTION_BACKENDS,
    AUTO,
    EAGER,
    FLASH,
    FLEX,
    SDPA,
    check_backend_name,
)


class EagerBackend(AttentionBackend):
    """The dense [B, L, L] (context parallel: [B, L/N, row_len]) mask: the reference."""

    name = EAGER
    per_rank_key_spans = True

    def check(self, device, seq_len, *, chunks=1, training=False) -> None:
        check_dense_mask_len(seq_len, f"attn_backend={EAGER!r} builds a dense [B, L, L] mask and")

    def metadata(self, batch: PackedBatch) -> Tensor:
        return batch.to_dense_mask().unsqueeze(1)

    def attend(self, q, k, v, data) -> Tensor:
        return eager_attention(q, k, v, data)

    def attend_row(self, q, k, v, k_row, v_row, data) -> Tensor:
        return eager_attention(q, k_row, v_row, data)


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


@functools.cache
def backends() -> dict[str, AttentionBackend]:
    """The one registry: backend name -> its object (the backend modules subclass this module's
    AttentionBackend, so they are imported on first use)."""
    from longctx.model.attention.flash import FlashBackend
    from longctx.model.attention.flex import FlexBackend
    from longctx.model.attention.sdpa import SdpaBackend

    registry = {b.name: b for b in (FlashBackend(), FlexBackend(), SdpaBackend(), EagerBackend())}
    assert tuple(registry) == ATTENTION_BACKENDS
    return registry


def get_backend(name: str) -> AttentionBackend:
    """The backend object of a resolved name (not "auto")."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"got backend={name!r}; expected a resolved backend, one of {ATTENTION_BACKENDS} "
            "(call resolve_backend first)"
        )
    return backends()[name]


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Map "auto" to the best backend for ``device``; check an explicit one can run there.

    auto: flash on CUDA with flash-attn installed, else flex on CUDA, else sdpa.
    """
    device = torch.device(device)
    check_backend_name(name)
    if name == AUTO:
        if device.type == "cuda":
            from longctx.model.attention.flash import flash_attn_importable

            return FLASH if flash_attn_importable() else FLEX
        return SDPA
    get_backend(name).check_device(device)
    return name


@dataclasses.dataclass
class AttentionMetadata:
    """What the layers need from a PackedBatch; built once per forward, shared by layers.

    ``data`` is the backend's own (an SdpaMetadata, a FlashMetadata, a BlockMask, a dense
    mask). For a ContextShard (``shard``), L is the local length L/N and keys span the row.
    """

    backend: AttentionBackend
    batch_size: int
    seq_len: int
    device: torch.device
    data: object = None
    shard: ContextShard | None = None


def build_attention_metadata(batch: PackedBatch, backend: str) -> AttentionMetadata:
    """Derive what ``backend`` (already resolved, not "auto") needs from ``batch``."""
    owner = get_backend(backend)
    _check_batch_on_one_device(batch)
    device = batch.tokens.device
    shard = batch if isinstance(batch, ContextShard) else None
    chunks = 1
    if shard is not None:
        if shard.cp_size > 1 and shard.all_gather is None:
            raise ValueError(
                f"a ContextShard of cp_size={shard.cp_size} needs the process group of its "
                "ranks to gather keys and values: context_shard(batch, rank, size, "
                "all_gather_over(group)) (longctx.distributed.context_parallel)"
            )
        owner.check_context_parallel(shard.balance)
        chunks = shard.chunks
    owner.check(device, batch.row_len, chunks=chunks)
    b, length = batch.shape
    return AttentionMetadata(owner, b, length, device, owner.metadata(batch), shard)


def _check_batch_on_one_device(batch: PackedBatch) -> None:
    devices = {t.device for t in (batch.tokens, batch.seq_lens, batch.position_ids)}
    if len(devices) != 1:
        raise ValueError(f"PackedBatch tensors are on several devices {devices}; move it whole")


# Under compile=true the blocks are compiled around this call, never through it: the metadata
# (bucket shapes, document spans) changes with every batch's layout, and tracing it would
# recompile every step. Each backend's kernel is fused already; flex compiles its own.
@torch.compiler.disable
def attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    """Document-causal attention. q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D] (q dtype)."""
    _check_qkv(q, k, v, meta)
    if meta.shard is not None:
        return context_attention(q, k, v, meta)
    return meta.backend.attend(q, k, v, meta.data)


def context_attention(q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
    """Local queries [B, L/N, H, D] against the whole rows' keys, gathered from the group.

    The local K/V are read back from the gathered rows: so every rank's backward runs the
    gather's reduce-scatter, whatever its own pieces need. A rank holding only whole documents
    would otherwise use no gathered key, skip it, and leave the other ranks waiting in theirs.
    """
    shard = meta.shard
    k_row, v_row = (gather_row(x, shard) for x in (k, v))
    k_own, v_own = (own_tokens(x, shard) for x in (k_row, v_row))
    return attention_over_row(q, k_own, v_own, k_row, v_row, meta)


def attention_over_row(
    q: Tensor, k: Tensor, v: Tensor, k_row: Tensor, v_row: Tensor, meta: AttentionMetadata
) -> Tensor:
    """The shard's queries q [B, L/N, H, D] given its own keys k, v [B, L/N, Hkv, D] and the
    whole rows' keys k_row, v_row [B, L, Hkv, D]; the gather's consumer, separate for tests."""
    return meta.backend.attend_row(q, k, v, k_row, v_row, meta.data)


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
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    meta.backend.check_dtype(q.dtype)
    if not (q.device == k.device == v.device == meta.device):
        raise ValueError(
            f"q, k, v are on {q.device}, {k.device}, {v.device} but the attention metadata was "
            f"built for a batch on {meta.device}; move the batch to the model's device first"
        )
