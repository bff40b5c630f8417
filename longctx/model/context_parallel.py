"""Context parallelism: one packed row split over N ranks, documents masked exactly.

Each rank holds chunks r and 2N-1-r of every row, or of every one of k segments of the row with
k rounds (``PackedBatch.context_shard``). Attention is
the all-gather design of the Llama 3 paper: every layer gathers the whole row's K and V from the
group (cheap with GQA: only the Hkv heads travel) and the rank's own queries attend to them under
the document mask. The gather's backward is a reduce-scatter: each rank receives the K/V gradient
of its own tokens summed over every rank's queries.

What a local query sees: the keys of its own piece (causal) and, when its document began on an
earlier chunk, the ``key_prefix_lens`` keys before the piece. Per backend:

- ``sdpa``: the shard's pieces run through the usual per-document plan on the *local* K/V (exact
  for every piece whose document starts in the chunk); the at most 2k pieces per row whose
  document started earlier (one per chunk, at its first token) are then recomputed against the
  gathered keys with a lower-right causal mask (in query blocks under checkpoint, so no mask
  outlives its block) and spliced in.
- ``flash``: varlen with separate query and key cu_seqlens; the keys of each piece are its
  document's span of the gathered row, and the kernel's causal mask is aligned bottom-right.
- ``flex``: a BlockMask of local query tiles against the row's key tiles.
- ``eager``: the dense [B, L/N, L] mask (the reference, small L).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longctx.batch import ContextShard, context_chunks

# Elements of one query block's [q, k] mask in the sdpa path (4M: a 16 MB fp32 additive mask).
MASK_BLOCK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class ContextMetadata:
    """The context-parallel part of AttentionMetadata (built once per forward).

    prefixed: (flat query start, query length, flat key start, key length) of every piece whose
        document began before it, over the local B*L/N queries and the gathered B*L keys;
        prefixed_query_index / prefixed_key_index: those spans' flat indices, concatenated.
    key_index / cu_seqlens_k / max_seqlen_k: flash only; the packed key spans of all pieces.
    """

    group: object
    size: int
    rounds: int
    row_len: int
    prefixed: tuple[tuple[int, int, int, int], ...] = ()
    prefixed_query_index: Tensor | None = None
    prefixed_key_index: Tensor | None = None
    key_index: Tensor | None = None
    cu_seqlens_k: Tensor | None = None
    max_seqlen_k: int = 0


def build_context_metadata(shard: ContextShard, backend: str) -> ContextMetadata:
    if shard.cp_size > 1 and shard.group is None:
        raise ValueError(
            f"a ContextShard of cp_size={shard.cp_size} needs the process group of its ranks "
            "(PackedBatch.context_shard(rank, size, group)) to gather keys and values"
        )
    meta = ContextMetadata(shard.group, shard.cp_size, shard.cp_rounds, shard.row_len)
    if backend not in ("sdpa", "flash"):  # eager and flex read the shard's own mask inputs
        return meta
    spans, device = _piece_spans(shard), shard.tokens.device
    if backend == "sdpa":
        prefixed = tuple(s for s in spans if s[1] != s[3])
        if not prefixed:
            return meta
        return dataclasses.replace(
            meta,
            prefixed=prefixed,
            prefixed_query_index=_span_index([(s[0], s[1]) for s in prefixed]).to(device),
            prefixed_key_index=_span_index([(s[2], s[3]) for s in prefixed]).to(device),
        )
    key_lens = torch.tensor([s[3] for s in spans], dtype=torch.int32)
    return dataclasses.replace(
        meta,
        key_index=_span_index([(s[2], s[3]) for s in spans]).to(device),
        cu_seqlens_k=F.pad(key_lens.cumsum(0, dtype=torch.int32), (1, 0)).to(device),
        max_seqlen_k=int(key_lens.max()),
    )


def _span_index(spans: list[tuple[int, int]]) -> Tensor:
    """int64 flat indices of the (start, length) spans, concatenated."""
    return torch.cat([torch.arange(start, start + n) for start, n in spans])


def _piece_spans(shard: ContextShard) -> list[tuple[int, int, int, int]]:
    """(flat query start, query length, flat key start, key length) of every piece, in order."""
    b, local_len = shard.shape
    global_index = shard.global_index.tolist()
    spans = []
    for row, (lens, prefixes) in enumerate(
        zip(shard.seq_lens.tolist(), shard.key_prefix_lens.tolist(), strict=True)
    ):
        start = 0
        for n, prefix in zip(lens, prefixes, strict=True):
            if n == 0:
                break
            key_start = row * shard.row_len + global_index[start] - prefix
            spans.append((row * local_len + start, n, key_start, prefix + n))
            start += n
    return spans


# --------------------------------------------------------------------------- gather
def gather_row(x_local: Tensor, group, size: int, rounds: int = 1) -> Tensor:
    """[B, L/N, ...] local chunks of every rank -> [B, L, ...] whole rows, in row order.

    Differentiable: the backward reduce-scatters the rows' gradient back to the owning ranks.
    """
    b, local_len = x_local.shape[:2]
    per_rank = 2 * rounds
    c = local_len // per_rank
    chunks = x_local.reshape(b, per_rank, c, *x_local.shape[2:]).transpose(0, 1)  # [2k, B, c]
    if size > 1:  # rank r's chunks land at r*2k .. r*2k + 2k-1
        chunks = _AllGather.apply(chunks, group)
    held = [g for r in range(size) for g in context_chunks(r, size, rounds)]
    order = sorted(range(len(held)), key=held.__getitem__)  # gathered slot of each row chunk
    ordered = chunks.index_select(0, torch.tensor(order, device=x_local.device))
    return ordered.transpose(0, 1).reshape(b, size * local_len, *x_local.shape[2:])


class _AllGather(torch.autograd.Function):
    """all-gather along dim 0 over ``group``; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


# torch renamed the single-tensor collectives (the old names warn from 2.13)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# --------------------------------------------------------------------------- sdpa
def splice_prefixed_pieces(
    out_local: Tensor, q: Tensor, k_row: Tensor, v_row: Tensor, meta: ContextMetadata
) -> Tensor:
    """Replace the outputs of pieces whose document began earlier by attention over their
    document's whole key span. out_local, q [B, L/N, H, D]; k_row, v_row [B, L, Hkv, D]."""
    if not meta.prefixed:
        return out_local
    b, local_len, h, d = q.shape
    # one gather per tensor, then views: slicing each span out of the whole tensors would give
    # every span a full-size gradient buffer in backward
    q_lens, k_lens = [s[1] for s in meta.prefixed], [s[3] for s in meta.prefixed]
    q_spans = q.reshape(b * local_len, h, d).index_select(0, meta.prefixed_query_index)
    k_spans, v_spans = (
        x.reshape(-1, *x.shape[2:]).index_select(0, meta.prefixed_key_index).split(k_lens)
        for x in (k_row, v_row)
    )
    fixed = [
        lower_right_causal_attention(q_span, k_span, v_span)
        for q_span, k_span, v_span in zip(q_spans.split(q_lens), k_spans, v_spans, strict=True)
    ]
    flat = out_local.reshape(b * local_len, h, d)
    spliced = flat.index_copy(0, meta.prefixed_query_index, torch.cat(fixed))
    return spliced.view(b, local_len, h, d)


def lower_right_causal_attention(q_QHD: Tensor, k_KHD: Tensor, v_KHD: Tensor) -> Tensor:
    """Queries that are the last Q of K keys: query i sees keys 0 .. K-Q+i. -> [Q, H, D].

    In blocks of queries whose [q, k] mask has at most MASK_BLOCK_ELEMENTS, each under
    checkpoint when gradients are on: SDPA would keep its float mask for backward, which over
    the 2k pieces per row of every layer adds up to gigabytes at 128k (measured); rebuilt in
    backward instead, memory stays one block's whatever Q, K and the number of pieces.
    """
    q_len, k_len = q_QHD.shape[0], k_KHD.shape[0]
    block = max(1, MASK_BLOCK_ELEMENTS // k_len)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_QHD, k_KHD, v_KHD))
    outs = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        visible = k_len - q_len + stop  # keys seen by the block's last query
        args = (q_QHD[start:stop], k_KHD[:visible], v_KHD[:visible])
        outs.append(
            checkpoint(_masked_block, *args, use_reentrant=False) if grad else _masked_block(*args)
        )
    return torch.cat(outs)


def _masked_block(q_QHD: Tensor, k_KHD: Tensor, v_KHD: Tensor) -> Tensor:
    q_len, k_len = q_QHD.shape[0], k_KHD.shape[0]
    mask_QK = torch.ones(q_len, k_len, dtype=torch.bool, device=q_QHD.device).tril(k_len - q_len)
    q_1HQD, k_1HKD, v_1HKD = (x.transpose(0, 1).unsqueeze(0) for x in (q_QHD, k_KHD, v_KHD))
    out_1HQD = F.scaled_dot_product_attention(
        q_1HQD, k_1HKD, v_1HKD, attn_mask=mask_QK, enable_gqa=q_QHD.shape[1] != k_KHD.shape[1]
    )
    return out_1HQD[0].transpose(0, 1)
