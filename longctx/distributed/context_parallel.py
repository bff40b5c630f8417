"""Context parallelism: one packed row split over N ranks, documents masked exactly.

Each rank holds chunks r and 2N-1-r of every row, or of every one of k segments of the row with
k rounds (:func:`context_shard`). Attention is
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
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint

from longctx.batch import PackedBatch, check_dense_mask_len

# Elements of one query block's [q, k] mask in the sdpa path (4M: a 16 MB fp32 additive mask).
MASK_BLOCK_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------- the split
def check_context_parallel(
    size: int,
    rounds: int = 1,
    *,
    rank: int = 0,
    seq_len: int | None = None,
    world: int | None = None,
) -> None:
    """The one owner of the split's rules: ``size`` ranks share each row (dividing the
    ``world``), cut into ``2 * size * rounds`` equal chunks (dividing ``seq_len``)."""
    for name, value in (("context_parallel", size), ("rounds", rounds), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r}; expected an int")
    if size < 1 or rounds < 1 or not 0 <= rank < size:
        raise ValueError(
            f"context parallel rank={rank}, size={size}, rounds={rounds}; expected size >= 1, "
            "rounds >= 1, 0 <= rank < size"
        )
    if world is not None and world % size:
        raise ValueError(
            f"context_parallel={size} must divide the world size {world} (processes x nodes): "
            "each row is split over that many ranks"
        )
    chunks = 2 * size * rounds
    if seq_len is not None and seq_len % chunks:
        raise ValueError(
            f"a row of L={seq_len} tokens cannot be split over context parallel size {size} in "
            f"{rounds} round(s): L must be a multiple of 2*size*rounds={chunks} "
            "(each rank takes two equal chunks per round)"
        )


def context_shard(
    batch: PackedBatch, rank: int, size: int, group=None, rounds: int = 1
) -> ContextShard:
    """Rank ``rank``'s share of every row when ``size`` ranks split each row.

    A row is cut into 2*size chunks and the rank takes chunks ``rank`` and
    ``2*size-1-rank``: an early chunk (little causal work) paired with a late one (much).
    With ``rounds`` = k > 1 the row is cut into k segments of 2*size chunks each and the rank
    takes that pair in every segment: finer interleaving, which evens out document-masked
    work, where a rank's cost is the sum of its pieces' squared lengths, not its position.
    Tokens, labels and position ids are sliced with the chunks; segments are cut at the
    chunk edges into pieces, and every piece records how many tokens of its document
    precede it on other chunks: the keys it must fetch from other ranks. Documents may have
    any length and cross any chunk edge. ``group``: the process group of the ``size`` ranks
    (group rank = ``rank``), needed by the model to gather keys and values when size > 1.
    """
    b, length = batch.shape
    check_context_parallel(size, rounds, rank=rank, seq_len=length)
    c = length // (2 * size * rounds)
    chunks = [(g * c, (g + 1) * c) for g in context_chunks(rank, size, rounds)]
    local_idx = torch.cat([torch.arange(lo, hi) for lo, hi in chunks])
    pieces = [_chunk_pieces(row[row > 0], chunks) for row in batch.seq_lens.cpu().numpy()]
    lens, prefixes = (
        pad_sequence([torch.tensor(p[i], dtype=torch.int32) for p in pieces], batch_first=True)
        for i in (0, 1)
    )
    device = batch.tokens.device
    local_idx = local_idx.to(device)
    return ContextShard(
        tokens=batch.tokens[:, local_idx],
        labels=batch.labels[:, local_idx],
        position_ids=batch.position_ids[:, local_idx],
        seq_lens=lens.to(device),
        key_prefix_lens=prefixes.to(device),
        row_seq_lens=batch.seq_lens,
        cp_rank=rank,
        cp_size=size,
        group=group,
        cp_rounds=rounds,
    )


def context_chunks(rank: int, size: int, rounds: int = 1) -> list[int]:
    """The row chunks (of 2 * size * rounds) that context-parallel ``rank`` holds, in order."""
    per_round = 2 * size
    return [j * per_round + i for j in range(rounds) for i in (rank, per_round - 1 - rank)]


@dataclasses.dataclass
class ContextShard(PackedBatch):
    """One rank's share of a PackedBatch under context parallelism (:func:`context_shard`).

    tokens, labels, position_ids [B, L/N] the rank's 2k chunks of c tokens of each row, in
                             row order (k = cp_rounds; chunks context_chunks(cp_rank, cp_size, k))
    seq_lens        [B, S]   the local tokens cut into pieces: a segment's tokens in one chunk
    key_prefix_lens [B, S]   tokens of each piece's segment that precede the piece in the row
    row_seq_lens    [B, S']  the whole rows' segment lengths
    group                    process group of the cp_size ranks (None when cp_size == 1)

    Attention: a local query attends causally to its own piece and to its segment's earlier
    tokens, which may live on other ranks' chunks (``key_prefix_lens`` of them).
    """

    key_prefix_lens: Tensor
    row_seq_lens: Tensor
    cp_rank: int
    cp_size: int
    group: object = None
    cp_rounds: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_prefix_lens.shape != self.seq_lens.shape:
            raise ValueError(
                f"key_prefix_lens has shape {tuple(self.key_prefix_lens.shape)}, expected the "
                f"shape of seq_lens {tuple(self.seq_lens.shape)}"
            )
        check_context_parallel(
            self.cp_size, self.cp_rounds, rank=self.cp_rank, seq_len=self.row_len
        )

    @property
    def chunk_len(self) -> int:
        return self.shape[1] // (2 * self.cp_rounds)

    @property
    def row_len(self) -> int:
        return self.shape[1] * self.cp_size

    @cached_property
    def global_index(self) -> Tensor:
        """int64 [L/N]: the row position of each local token."""
        c, device = self.chunk_len, self.tokens.device
        chunks = torch.tensor(context_chunks(self.cp_rank, self.cp_size, self.cp_rounds))
        return (chunks.to(device)[:, None] * c + torch.arange(c, device=device)).flatten()

    @cached_property
    def row_doc_ids(self) -> Tensor:
        """int64 [B, row_len]: the segment index of every token of the whole rows."""
        b, s = self.row_seq_lens.shape
        ids = torch.arange(s, device=self.row_seq_lens.device).repeat(b)
        return ids.repeat_interleave(self.row_seq_lens.flatten().long()).view(b, self.row_len)

    def to_dense_mask(self) -> Tensor:
        """bool [B, row_len / cp_size, row_len], True where local query i may attend to row key j."""
        check_dense_mask_len(self.row_len, "to_dense_mask()")
        q_pos = self.global_index.to(self.row_doc_ids.device)
        q_doc = self.row_doc_ids[:, q_pos]
        same_doc = q_doc[:, :, None] == self.row_doc_ids[:, None, :]
        keys = torch.arange(self.row_len, device=q_pos.device)
        return same_doc & (keys[None, :] <= q_pos[:, None])


def _chunk_pieces(row_lens: np.ndarray, chunks: list[tuple[int, int]]):
    """(piece lengths, key prefix lengths) of a row's segments cut at the chunks' edges."""
    ends = np.cumsum(row_lens)
    lens, prefixes = [], []
    for lo, hi in chunks:
        bounds = np.concatenate(([lo], ends[(ends > lo) & (ends < hi)], [hi]))
        first = int(np.searchsorted(ends, lo, side="right"))  # the segment holding token lo
        lens += np.diff(bounds).tolist()
        prefixes += [lo - int(ends[first] - row_lens[first])] + [0] * (len(bounds) - 2)
    return lens, prefixes


# --------------------------------------------------------------------------- key spans
def span_index(spans: list[tuple[int, int]]) -> Tensor:
    """int64 flat indices of the (start, length) spans, concatenated."""
    return torch.cat([torch.arange(start, start + n) for start, n in spans])


def piece_spans(shard: ContextShard) -> list[tuple[int, int, int, int]]:
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


# --------------------------------------------------------------------------- masks
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


# Process groups: ranks form a (data parallel x context parallel) mesh. Global rank r is
# context-parallel rank r % N of data-parallel replica r // N: the N ranks sharing a row are
# consecutive, so on a multi-GPU node they sit on one node, where the per-layer K/V all-gather is
# fastest. Gradients are still reduced over the whole world by DDP or FSDP2 (every rank holds
# different tokens), so those strategies need no change.
def data_parallel_rank_and_size(rank: int, world: int, context_parallel: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` in a world of ``world``."""
    check_context_parallel(context_parallel, world=world)
    return rank // context_parallel, world // context_parallel


def context_parallel_group(context_parallel: int):
    """This rank's group of ``context_parallel`` consecutive ranks: the "cp" dimension of a
    ("dp", "cp") device mesh (row-major, so cp ranks are consecutive)."""
    world = dist.get_world_size()
    check_context_parallel(context_parallel, world=world)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device, (world // context_parallel, context_parallel), mesh_dim_names=("dp", "cp")
    )
    return mesh.get_group("cp")
