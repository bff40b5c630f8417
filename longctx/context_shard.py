"""Context-parallel layout: which tokens of a packed row each of N ranks holds, and how the
whole row is put back together. Pure rank arithmetic over tensors: no process group here.

Which rank holds which tokens is a balancer's plan (:mod:`longctx.cp_balance`: ``head_tail``,
``rounds`` or ``documents``); every rank holds L/N tokens of each row, in row order, with their
labels and position ids. Attention is the all-gather design of the Llama 3 paper: every layer
gathers the whole row's K and V from the group (cheap with GQA: only the Hkv heads travel) and
the rank's own queries attend to them under the document mask. The gather's backward is a
reduce-scatter: each rank receives the K/V gradient of its own tokens summed over every rank's
queries. The collective itself is the process-group code's
(:func:`longctx.distributed.context_parallel.all_gather_over`): a shard carries it, so the model
gathers rows without importing any process-group code.

The local tokens are cut into *pieces*: runs of consecutive row positions inside one segment.
A piece's queries see the keys of their segment up to themselves: the piece itself (causal)
and the ``key_prefix_lens`` tokens of the segment before it, wherever they live (how each
attention backend attends them: :mod:`longctx.model.attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cached_property

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from longctx.batch import PackedBatch, check_dense_mask_len
from longctx.cp_balance import (
    DEFAULT_BALANCE,
    DOCUMENTS,
    HEAD_TAIL,
    PlanStats,
    check_balance,
    plan_stats,
    position_runs,
    rank_unit,
    row_owner,
)
from longctx.errors import LongctxError

# All-gathers along dim 0 over the shard's ranks: every rank's [1, B, L/N, ...] -> [N, B, L/N,
# ...], rank r's at [r]; differentiable (backward: a reduce-scatter of the gradient).
AllGather = Callable[[Tensor], Tensor]


def check_context_parallel(
    size: int,
    rounds: int = 1,
    *,
    rank: int = 0,
    seq_len: int | None = None,
    world: int | None = None,
    balance: str = HEAD_TAIL,
) -> None:
    """The one owner of the split's rules: ``size`` ranks share each row (dividing the
    ``world``), a known balancer, and rows it can split evenly: ``seq_len`` a multiple of
    2 * size * rounds chunks (head-tail) or of size (documents)."""
    for name, value in (("context_parallel", size), ("rounds", rounds), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LongctxError(f"{name}={value!r}; expected an int")
    if size < 1 or rounds < 1 or not 0 <= rank < size:
        raise LongctxError(
            f"context parallel rank={rank}, size={size}, rounds={rounds}; expected size >= 1, "
            "rounds >= 1, 0 <= rank < size"
        )
    check_balance(balance, rounds)
    if world is not None and world % size:
        raise LongctxError(
            f"context_parallel={size} must divide the world size {world} (processes x nodes): "
            "each row is split over that many ranks"
        )
    unit = rank_unit(size, balance, rounds)
    if seq_len is None or seq_len % unit == 0:
        return
    if balance == DOCUMENTS:
        raise LongctxError(
            f"a row of L={seq_len} tokens cannot be split over context parallel size {size}: "
            f"L must be a multiple of size={size} (each rank holds L/size tokens of every row)"
        )
    raise LongctxError(
        f"a row of L={seq_len} tokens cannot be split over context parallel size {size} in "
        f"{rounds} round(s): L must be a multiple of 2*size*rounds={unit} "
        "(each rank takes two equal chunks per round)"
    )


def context_shard(
    batch: PackedBatch,
    rank: int,
    size: int,
    all_gather: AllGather | None = None,
    *,
    balance: str = DEFAULT_BALANCE,
    rounds: int = 1,
) -> ContextShard:
    """Rank ``rank``'s share of every row when ``size`` ranks split each row.

    ``balance`` picks the plan (see :mod:`longctx.cp_balance`; ``rounds`` is the ``rounds``
    balancer's head-tail rounds). The plan of every row is computed whole, for every rank, from
    the row's segment lengths alone. Tokens, labels and position ids travel with the plan; the
    local tokens are cut into pieces, each recording how many tokens of its segment precede it
    in the row (the keys it needs from before itself). Documents may have any length and be cut
    anywhere. ``all_gather``: the collective over the ``size`` ranks (group rank = ``rank``;
    :func:`longctx.distributed.context_parallel.all_gather_over`), needed by the model to
    gather keys and values when size > 1.
    """
    b, length = batch.shape
    check_context_parallel(size, rounds, rank=rank, seq_len=length, balance=balance)
    lens_rows = [row[row > 0].astype(np.int64) for row in batch.seq_lens.cpu().numpy()]
    owners = np.stack([row_owner(lens, size, balance, rounds) for lens in lens_rows])
    # every row's positions grouped by rank, in row order within a rank: rank r's are the
    # r-th L/N of each row, which is also where they land in the all-gather
    order = np.argsort(owners, axis=1, kind="stable")
    local = length // size
    global_index = order[:, rank * local : (rank + 1) * local]
    # each run: its length and the keys of its document before it (on other ranks)
    pieces = [position_runs(q, lens)[1:3] for q, lens in zip(global_index, lens_rows, strict=True)]
    lens, prefixes = (
        pad_sequence([torch.from_numpy(p[i]).int() for p in pieces], batch_first=True)
        for i in (0, 1)
    )
    device = batch.tokens.device
    index = torch.from_numpy(global_index).to(device)
    return ContextShard(
        tokens=batch.tokens.gather(1, index),
        labels=batch.labels.gather(1, index),
        position_ids=batch.position_ids.gather(1, index),
        seq_lens=lens.to(device),
        key_prefix_lens=prefixes.to(device),
        row_seq_lens=batch.seq_lens,
        global_index=index,
        gather_index=torch.from_numpy(_gather_index(order, b, local)).to(device),
        cp_rank=rank,
        cp_size=size,
        all_gather=all_gather,
        balance=balance,
        cp_rounds=rounds,
        plan=plan_stats(lens_rows, list(owners), size),
    )


def _gather_index(order: np.ndarray, b: int, local: int) -> np.ndarray:
    """int64 [B * L]: for each row position, its element of the all-gathered [N, B, L/N]."""
    length = order.shape[1]
    slot = np.empty_like(order)  # position -> its index in ``order`` (rank * local + j)
    np.put_along_axis(slot, order, np.arange(length)[None].repeat(b, 0), axis=1)
    rank, j = np.divmod(slot, local)
    return (rank * b * local + np.arange(b)[:, None] * local + j).reshape(-1)


@dataclasses.dataclass
class ContextShard(PackedBatch):
    """One rank's share of a PackedBatch under context parallelism (:func:`context_shard`).

    tokens, labels, position_ids [B, L/N] the rank's tokens of each row, in row order
    seq_lens        [B, S]   the local tokens cut into pieces: runs of consecutive row
                             positions inside one segment
    key_prefix_lens [B, S]   tokens of each piece's segment that precede the piece in the row
    row_seq_lens    [B, S']  the whole rows' segment lengths
    global_index    [B, L/N] int64, the row position of each local token
    gather_index    [B * L]  int64, the element of the all-gathered [N, B, L/N] that holds
                             each row position (:func:`gather_row`)
    all_gather               the collective over the cp_size ranks (None when cp_size == 1)
    balance, cp_rounds       the balancer that made the plan
    plan                     the plan's work and pieces per rank (summed over the rows)

    Attention: a local query attends causally to its own piece and to its segment's earlier
    tokens, which may live on other ranks (``key_prefix_lens`` of them).
    """

    key_prefix_lens: Tensor
    row_seq_lens: Tensor
    global_index: Tensor
    gather_index: Tensor
    cp_rank: int
    cp_size: int
    all_gather: AllGather | None = None
    balance: str = HEAD_TAIL
    cp_rounds: int = 1
    plan: PlanStats | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, shape in (
            ("key_prefix_lens", self.seq_lens.shape),
            ("global_index", self.tokens.shape),
            ("gather_index", (self.shape[0] * self.row_len,)),
        ):
            if getattr(self, name).shape != shape:
                raise LongctxError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}"
                )
        check_context_parallel(
            self.cp_size,
            self.cp_rounds,
            rank=self.cp_rank,
            seq_len=self.row_len,
            balance=self.balance,
        )

    @property
    def row_len(self) -> int:
        return self.shape[1] * self.cp_size

    @property
    def chunks(self) -> int:
        """Equal query chunks a row is cut into (2N per round; N under ``documents``), which
        a backend may need in whole tiles."""
        return rank_unit(self.cp_size, self.balance, self.cp_rounds)

    @cached_property
    def row_doc_ids(self) -> Tensor:
        """int64 [B, row_len]: the segment index of every token of the whole rows."""
        b, s = self.row_seq_lens.shape
        ids = torch.arange(s, device=self.row_seq_lens.device).repeat(b)
        return ids.repeat_interleave(self.row_seq_lens.flatten().long()).view(b, self.row_len)

    @cached_property
    def row_doc_starts(self) -> Tensor:
        """int64 [B, row_len]: the row position where each token's segment starts."""
        lens = self.row_seq_lens.long()
        starts = lens.cumsum(1) - lens
        return starts.flatten().repeat_interleave(lens.flatten()).view(-1, self.row_len)

    def to_dense_mask(self) -> Tensor:
        """bool [B, row_len / cp_size, row_len], True where local query i may attend to row key j."""
        check_dense_mask_len(self.row_len, "to_dense_mask()")
        q_pos = self.global_index.to(self.row_doc_ids.device)
        q_doc = self.row_doc_ids.gather(1, q_pos)
        same_doc = q_doc[:, :, None] == self.row_doc_ids[:, None, :]
        keys = torch.arange(self.row_len, device=q_pos.device)
        return same_doc & (keys[None, None, :] <= q_pos[:, :, None])


def span_index(spans: list[tuple[int, int]]) -> Tensor:
    """int64 flat indices of the (start, length) spans, concatenated."""
    return torch.cat([torch.arange(start, start + n) for start, n in spans])


def piece_spans(shard: ContextShard) -> list[tuple[int, int, int, int]]:
    """(flat query start, query length, flat key start, key length) of every piece, in order."""
    b, local_len = shard.shape
    spans = []
    for row, (positions, lens, prefixes) in enumerate(
        zip(
            shard.global_index.tolist(),
            shard.seq_lens.tolist(),
            shard.key_prefix_lens.tolist(),
            strict=True,
        )
    ):
        start = 0
        for n, prefix in zip(lens, prefixes, strict=True):
            if n == 0:
                break
            key_start = row * shard.row_len + positions[start] - prefix
            spans.append((row * local_len + start, n, key_start, prefix + n))
            start += n
    return spans


def gather_row(x_local: Tensor, shard: ContextShard) -> Tensor:
    """[B, L/N, ...] local tokens of every rank of ``shard``'s group -> [B, L, ...] whole
    rows, in row order.

    Differentiable: the backward reduce-scatters the rows' gradient back to the owning ranks.
    """
    b, rest = x_local.shape[0], x_local.shape[2:]
    gathered = x_local.unsqueeze(0)  # [1, B, L/N, ...]
    if shard.cp_size > 1:  # rank r's tokens land at [r]
        gathered = shard.all_gather(gathered)
    flat = gathered.reshape(-1, *rest)
    index = shard.gather_index.to(x_local.device)
    return flat.index_select(0, index).view(b, shard.row_len, *rest)


def own_tokens(x_row: Tensor, shard: ContextShard) -> Tensor:
    """[B, L, ...] whole rows -> [B, L/N, ...] this rank's tokens of them (gather_row's
    inverse on this rank)."""
    b, local_len = shard.shape
    rows = torch.arange(b, device=x_row.device)[:, None] * shard.row_len
    index = (rows + shard.global_index.to(x_row.device)).flatten()
    return x_row.flatten(0, 1).index_select(0, index).view(b, local_len, *x_row.shape[2:])


# Ranks form a (data parallel x context parallel) mesh. Global rank r is context-parallel rank
# r % N of data-parallel replica r // N: the N ranks sharing a row are consecutive, so on a
# multi-GPU node they sit on one node, where the per-layer K/V all-gather is fastest. Gradients
# are still reduced over the whole world by DDP or FSDP2 (every rank holds different tokens),
# so those strategies need no change.
def data_parallel_rank_and_size(rank: int, world: int, context_parallel: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` in a world of ``world``."""
    check_context_parallel(context_parallel, world=world)
    return rank // context_parallel, world // context_parallel
