"""The `flex` backend: FlexAttention with a document-causal BlockMask built once per batch.

The BlockMask is computed directly from the segment layout rather than by evaluating the mask
function on every (q, kv) pair (``create_block_mask`` does that: ~1 s at L=2048 on CPU and an
L x L intermediate without compilation). Documents are contiguous runs, so a (q block, kv block)
tile is classified from the document ids at the tiles' first and last tokens alone:

- kv block after the q block: empty (causal);
- the diagonal tile: partial (causal inside it);
- kv block before the q block: full if both tiles lie in one document, partial if the kv
  tile's last document is the q tile's first document (one document spans the gap), else
  empty.

Partial tiles are resolved token by token by the mask_mod (same document and q >= kv).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from longctx.batch import PackedBatch, check_dense_mask_len
from longctx.context_shard import ContextShard
from longctx.errors import LongctxError
from longctx.model.attention.base import AttentionBackend
from longctx.model.attention.names import FLEX

FLEX_BLOCK_SIZE = 128


class FlexBackend(AttentionBackend):
    """FlexAttention under a document block mask. Context parallel: the shard's query tiles
    against the whole rows' key tiles, from the plan (the local rows, and under head-tail each
    chunk, must be whole tiles)."""

    name = FLEX
    per_rank_key_spans = True

    def check(self, device, seq_len, *, chunks=1, training=False) -> None:
        # a context-parallel shard's query tiles are rows of the row's tile map; training rows
        # are asked for whole tiles too
        if (chunks > 1 or training) and seq_len % (chunks * FLEX_BLOCK_SIZE):
            raise LongctxError(
                f"attn_backend='flex' needs L={seq_len} to be a multiple of {chunks} chunk(s) x "
                f"{FLEX_BLOCK_SIZE} = {chunks * FLEX_BLOCK_SIZE}: whole FlexAttention blocks per "
                "chunk"
            )
        if device.type != "cpu":
            return
        check_dense_mask_len(
            seq_len, "attn_backend='flex' on CPU runs uncompiled (it materialises the scores) and"
        )
        if training:
            _refuse_cpu_gradients()

    def metadata(self, batch: PackedBatch) -> BlockMask:
        if isinstance(batch, ContextShard):
            return build_context_block_mask(batch)
        return build_document_block_mask(batch)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, data: BlockMask) -> Tensor:
        return flex_document_attention(q, k, v, data)

    def attend_row(self, q, k, v, k_row, v_row, data: BlockMask) -> Tensor:
        return flex_document_attention(q, k_row, v_row, data)


def _refuse_cpu_gradients() -> None:
    raise RuntimeError(
        "attn_backend='flex' on CPU is forward-only: PyTorch has no CPU FlexAttention "
        "backward. Use attn_backend='sdpa' to train on CPU, or run flex under "
        "torch.no_grad() for evaluation."
    )


def build_document_block_mask(batch: PackedBatch, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """Document-causal BlockMask with B = batch rows and one head slot (shared by all heads)."""
    b, length = batch.shape
    n_blocks = -(-length // block_size)
    # doc ids padded to P = n_blocks * block_size tokens; the pad gets id -1 (its own document)
    doc_ids_BP = torch.full(
        (b, n_blocks * block_size), -1, dtype=torch.int64, device=batch.tokens.device
    )
    doc_ids_BP[:, :length] = batch.doc_ids
    tiles = doc_ids_BP.view(b, n_blocks, block_size)
    # ids increase along a row and the pad's -1 is smallest, so amax is a tile's last real id
    first_BN, last_BN = tiles[..., 0], tiles.amax(-1)
    partial_BQK, full_BQK = _classify_tiles(first_BN, last_BN)
    if length % block_size:  # the last q tile holds pad rows beyond L: mask them too
        partial_BQK[:, -1] |= full_BQK[:, -1]
        full_BQK[:, -1] = False
    mask_mod = document_causal_mask_mod(doc_ids_BP)
    return _block_mask(partial_BQK, full_BQK, mask_mod, block_size, (length, length))


def build_context_block_mask(shard: ContextShard, block_size: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """Context parallelism: the shard's local query tiles against the whole rows' key tiles.

    Built from the plan whatever the balancer: local query i (row position q_i) sees the keys
    [start of its segment, q_i], so a key tile is *partial* for a query tile when any of the
    tile's key ranges touches it, and *full* when every one covers it. The mask_mod maps local
    queries to row positions. Every tensor has a shape fixed by (B, L/N, L): a new document
    layout changes values only, so compiled flex does not recompile for it.
    """
    b, local_len = shard.shape
    n_q, n_kv = -(-local_len // block_size), -(-shard.row_len // block_size)
    row_pos = shard.global_index  # [B, L/N]
    first_key = shard.row_doc_starts.to(row_pos.device).gather(1, row_pos)
    pad = n_q * block_size - local_len  # a last partial query tile: its pad rows see nothing
    lo = F.pad(first_key, (0, pad), value=shard.row_len).view(b, n_q, block_size)
    hi = F.pad(row_pos, (0, pad), value=-1).view(b, n_q, block_size)
    touched = torch.zeros(b, n_q, n_kv + 1, dtype=torch.int32, device=row_pos.device)
    real = hi >= 0
    ones = real.to(torch.int32)
    touched.scatter_add_(2, (lo // block_size).clamp(max=n_kv) * real, ones)
    touched.scatter_add_(2, (hi // block_size + 1).clamp(min=0) * real, -ones)
    partial_BQK = touched.cumsum(2)[..., :n_kv] > 0
    kv_tile = torch.arange(n_kv, device=row_pos.device)
    # full: the tile lies inside every query's range [lo, hi] (a pad row makes none full)
    max_lo, min_hi = lo.amax(2, keepdim=True), hi.amin(2, keepdim=True)
    full_BQK = (kv_tile * block_size >= max_lo) & ((kv_tile + 1) * block_size - 1 <= min_hi)
    doc_ids = shard.row_doc_ids.to(row_pos.device)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = row_pos[b, q_idx]
        return (doc_ids[b, q_pos] == doc_ids[b, kv_idx]) & (q_pos >= kv_idx)

    lengths = (local_len, shard.row_len)
    return _block_mask(partial_BQK & ~full_BQK, full_BQK, mask_mod, block_size, lengths)


def _block_mask(partial_BQK, full_BQK, mask_mod, block_size: int, seq_lengths) -> BlockMask:
    kv_num, kv_idx = _as_block_lists(partial_BQK)
    full_num, full_idx = _as_block_lists(full_BQK)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=seq_lengths,
    )


def _classify_tiles(first_BN: Tensor, last_BN: Tensor) -> tuple[Tensor, Tensor]:
    """bool [B, Nq, Nkv] partial and full tile maps (see the module docstring).

    Only the last tile can hold pad tokens beyond L; as a kv tile it is only ever on the
    diagonal (partial), where the mask_mod keeps the pad (id -1) apart from real documents.
    """
    n = first_BN.shape[1]
    q_i = torch.arange(n, device=first_BN.device)[:, None]
    kv_j = torch.arange(n, device=first_BN.device)[None, :]
    before = (kv_j < q_i)[None]
    # a kv tile before the q tile shares a document with it iff its last doc is q's first doc
    touches = last_BN[:, None, :] == first_BN[:, :, None]
    one_doc = (first_BN[:, None, :] == last_BN[:, :, None]) & touches
    full = before & one_doc
    partial = (before & touches & ~one_doc) | (q_i == kv_j)[None]
    return partial, full


def _as_block_lists(tiles_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """BlockMask's format: per q tile, how many kv tiles, and their indices listed first."""
    num_B1Q = tiles_BQK.sum(-1, dtype=torch.int32)[:, None]
    idx_B1QK = torch.argsort(tiles_BQK.to(torch.int8), dim=-1, descending=True, stable=True)
    return num_B1Q, idx_B1QK.to(torch.int32)[:, None]


def document_causal_mask_mod(doc_ids_BP: Tensor):
    """mask_mod: query q may see key kv iff both lie in one document and kv <= q."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_ids_BP[b, q_idx] == doc_ids_BP[b, kv_idx]) & (q_idx >= kv_idx)

    return mask_mod


def flex_document_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D] under the document block mask."""
    if q.device.type == "cpu" and torch.is_grad_enabled() and _needs_grad(q, k, v):
        _refuse_cpu_gradients()
    kwargs = {"block_mask": block_mask, "enable_gqa": q.shape[2] != k.shape[2]}
    if q.device.type == "cuda":
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return _compiled_flex_attention()(*args, **kwargs).transpose(1, 2)
    # no gradient can flow here (grad mode off), but CPU flex refuses any requires_grad input
    args = (q.detach().transpose(1, 2), k.detach().transpose(1, 2), v.detach().transpose(1, 2))
    with warnings.catch_warnings():  # uncompiled on CPU is deliberate (L is capped upstream)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs).transpose(1, 2)


def _needs_grad(*tensors: Tensor) -> bool:
    return any(t.requires_grad for t in tensors)


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once per process: uncompiled it materialises the L x L scores."""
    return torch.compile(flex_attention, dynamic=False)
