"""The `sdpa` backend: per-document causal SDPA, documents batched into length buckets.

No L x L mask exists anywhere. Every segment of the flattened B*L tokens is one document; the
documents are grouped so that a group runs as ONE ``scaled_dot_product_attention(is_causal=True)``
call on [n_docs, H, pad_len, D]. A shorter document in a group is padded at its END: under
causal masking its real queries never see the pad keys (they come later), and the pad queries'
outputs are dropped, so padding costs compute but never changes a result.

Grouping trades padding compute against one call per document. Documents are visited longest
first; one joins the current group when its padded area ``pad_len**2 - n**2`` (token pairs of
wasted causal attention) stays within the device's budget, else it leads a new group. The budget
is about one call's fixed cost expressed in token pairs, so each joiner wastes at most what its
own call would have cost: the plan is never worse than a loop of one call per document, and
thousands of tiny documents collapse into a few calls.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longctx.batch import PackedBatch
from longctx.context_shard import ContextShard, piece_spans, span_index
from longctx.model.attention.base import AttentionBackend
from longctx.model.attention.names import SDPA

# Token pairs of padding worth one SDPA fwd+bwd call. CPU, measured at H=4, D=64, 1 thread:
# a call costs ~0.07 ms + 1.3 us/token + 5e-8 s/token pair, so ~1400 pairs; 32**2 measured best
# on 8k rows of tiny documents. CUDA: a call is ~0.1 ms of launches while a token pair costs
# ~1e-10 s at the 8B shape, so padding is far cheaper there (an estimate; benchmarks/gpu_bench.py
# times several budgets).
PAD_BUDGET_TOKENS2 = {"cpu": 32 * 32, "cuda": 512 * 512}
# Elements of one query block's [q, k] mask in the context-parallel path (4M: a 16 MB fp32
# additive mask).
MASK_BLOCK_ELEMENTS = 1 << 22


@dataclasses.dataclass(frozen=True)
class SdpaPlan:
    """How the flattened B*L tokens (T) become SDPA calls, and how the outputs come back.

    The flat tokens are split into consecutive runs (``run_sizes``): one split, whose backward
    is one cat, is the only op that reads the whole of q/k/v. A *direct* run is a whole bucket
    of unpadded, equal-length, consecutive documents (usually one long document): its SDPA call
    reads a view, no copy. Every other run is a stretch of consecutive documents that sit in
    *padded* buckets (the short ones): the stretches' tokens ("padded tokens", in flat order)
    are gathered into bucket slots with one index_select and their real outputs gathered back.

    direct: (run index, n_docs, pad_len) per direct run.
    padded_shapes: (n_docs, pad_len) per padded bucket; bucket i owns the next n_docs * pad_len
        slots, document-major.
    slot_token_idx: int64 [padded slots], the padded token behind each slot (pad slots repeat
        their document's last token).
    real_slot_idx: int64 [padded tokens], the slot of each padded token.
    padded_runs: indices of the runs that are stretches of padded documents, in flat order.

    Gradients thus never pass through a full-size zero tensor per bucket or per document, and
    the index ops' backward (index_add into zeros) only spans the padded tokens.
    """

    run_sizes: tuple[int, ...]
    direct: tuple[tuple[int, int, int], ...]
    padded_shapes: tuple[tuple[int, int], ...]
    slot_token_idx: Tensor | None
    real_slot_idx: Tensor | None
    padded_runs: tuple[int, ...]

    @property
    def bucket_shapes(self) -> tuple[tuple[int, int], ...]:
        """(n_docs, pad_len) of every SDPA call: direct runs first, then padded buckets."""
        return tuple((n, pad_len) for _, n, pad_len in self.direct) + self.padded_shapes


def group_documents(lengths: list[int], pad_budget: int) -> list[list[int]]:
    """Group document indices (into ``lengths``) so that each group is one padded SDPA call.

    The first index of every group is its longest document (the group's pad length).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] ** 2 - lengths[i] ** 2 <= pad_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_sdpa_plan(batch: PackedBatch, pad_budget: int | None = None) -> SdpaPlan:
    """Bucket every segment of ``batch`` (flattened over B*L) and index the buckets' slots.

    pad_budget: token pairs of padding a document may add to join a bucket; None = the
    default for the batch's device type.
    """
    if pad_budget is None:
        pad_budget = PAD_BUDGET_TOKENS2.get(batch.tokens.device.type, PAD_BUDGET_TOKENS2["cuda"])
    if pad_budget < 0:
        raise ValueError(f"pad_budget={pad_budget}; expected token pairs >= 0")
    lengths = [n for n in batch.seq_lens.flatten().tolist() if n > 0]
    groups = group_documents(lengths, pad_budget)
    direct_groups = [g for g in groups if _runs_in_place(g, lengths)]
    padded_groups = [g for g in groups if not _runs_in_place(g, lengths)]
    run_sizes, direct, padded_runs = _runs(lengths, direct_groups)
    slot_token_idx, real_slot_idx = _padded_slots(lengths, padded_groups)
    device = batch.tokens.device
    return SdpaPlan(
        run_sizes=run_sizes,
        direct=direct,
        padded_shapes=tuple((len(g), lengths[g[0]]) for g in padded_groups),
        slot_token_idx=None if slot_token_idx is None else slot_token_idx.to(device),
        real_slot_idx=None if real_slot_idx is None else real_slot_idx.to(device),
        padded_runs=padded_runs,
    )


def _runs_in_place(group: list[int], lengths: list[int]) -> bool:
    """A bucket of equal-length documents, consecutive in flat order, needs no gather."""
    return all(lengths[i] == lengths[group[0]] for i in group) and group == list(
        range(group[0], group[0] + len(group))
    )


def _runs(lengths: list[int], direct_groups: list[list[int]]):
    """Split the flat documents into direct runs and maximal stretches of padded documents."""
    direct_at = {g[0]: g for g in direct_groups}  # first document -> its direct bucket
    run_sizes: list[int] = []
    direct, padded_runs = [], []
    doc = 0
    while doc < len(lengths):
        if doc in direct_at:
            group = direct_at[doc]
            direct.append((len(run_sizes), len(group), lengths[doc]))
            run_sizes.append(len(group) * lengths[doc])
            doc += len(group)
            continue
        if not padded_runs or padded_runs[-1] != len(run_sizes) - 1:
            padded_runs.append(len(run_sizes))  # a new stretch of padded documents
            run_sizes.append(0)
        run_sizes[-1] += lengths[doc]
        doc += 1
    return tuple(run_sizes), tuple(direct), tuple(padded_runs)


def _padded_slots(lengths: list[int], padded_groups: list[list[int]]):
    """(slot -> padded token, padded token -> slot) for the padded buckets, where padded
    tokens number the tokens of the padded documents in flat order."""
    if not padded_groups:
        return None, None
    len_D = torch.tensor(lengths, dtype=torch.int64)  # D = documents (segments)
    is_padded_D = torch.zeros(len(lengths), dtype=torch.bool)
    is_padded_D[[i for g in padded_groups for i in g]] = True
    padded_len_D = torch.where(is_padded_D, len_D, 0)
    start_D = padded_len_D.cumsum(0) - padded_len_D  # start among padded tokens
    token_idx, real = [], []
    for group in padded_groups:
        pad_len = lengths[group[0]]
        offset_NP = torch.arange(pad_len).expand(len(group), pad_len)
        last_N1 = (len_D[group] - 1)[:, None]
        token_idx.append((start_D[group][:, None] + offset_NP.minimum(last_N1)).flatten())
        real.append((offset_NP <= last_N1).flatten())
    slot_token_idx, real_slot = torch.cat(token_idx), torch.cat(real)
    real_slot_idx = torch.empty(int(padded_len_D.sum()), dtype=torch.int64)
    real_slot_idx[slot_token_idx[real_slot]] = real_slot.nonzero().flatten()
    return slot_token_idx, real_slot_idx


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, plan: SdpaPlan) -> Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D], causal within each document."""
    b, length, h, d = q.shape
    q_runs, k_runs, v_runs = (
        x.reshape(b * length, x.shape[2], d).split(plan.run_sizes) for x in (q, k, v)
    )  # [run tokens, heads, D] views
    outs: list[Tensor | None] = [None] * len(plan.run_sizes)
    for run, n, pad_len in plan.direct:
        outs[run] = _bucket_attention(q_runs[run], k_runs[run], v_runs[run], n, pad_len)
    if plan.padded_runs:
        padded_out = _padded_attention(q_runs, k_runs, v_runs, plan)
        stretch_sizes = [plan.run_sizes[r] for r in plan.padded_runs]
        for run, out in zip(plan.padded_runs, padded_out.split(stretch_sizes), strict=True):
            outs[run] = out
    return _cat(outs).view(b, length, h, d)


def _padded_attention(q_runs, k_runs, v_runs, plan: SdpaPlan) -> Tensor:
    """Outputs of the padded documents, [padded tokens, H, D] in flat order."""
    q_b, k_b, v_b = (_bucket_slots(runs, plan) for runs in (q_runs, k_runs, v_runs))
    outs = [
        _bucket_attention(q_SHD, k_SHD, v_SHD, n, pad_len)
        for (n, pad_len), q_SHD, k_SHD, v_SHD in zip(plan.padded_shapes, q_b, k_b, v_b, strict=True)
    ]
    return _cat(outs).index_select(0, plan.real_slot_idx)


def _bucket_slots(runs: tuple[Tensor, ...], plan: SdpaPlan) -> tuple[Tensor, ...]:
    """Per padded bucket, [n_docs * pad_len, heads, D]: the padded stretches' tokens in slots."""
    padded_tokens = _cat([runs[r] for r in plan.padded_runs])
    sizes = [n * pad_len for n, pad_len in plan.padded_shapes]
    return padded_tokens.index_select(0, plan.slot_token_idx).split(sizes)


def _cat(tensors: list[Tensor]) -> Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _bucket_attention(q_SHD: Tensor, k_SHD: Tensor, v_SHD: Tensor, n: int, pad_len: int):
    """One causal SDPA call over a bucket's n documents of pad_len slots -> [n * pad_len, H, D]."""
    q_NHPD, k_NHPD, v_NHPD = (
        x.view(n, pad_len, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q_SHD, k_SHD, v_SHD)
    )
    k_NHPD, v_NHPD, gqa_kwargs = _gqa(q_NHPD, k_NHPD, v_NHPD)
    out_NHPD = F.scaled_dot_product_attention(q_NHPD, k_NHPD, v_NHPD, is_causal=True, **gqa_kwargs)
    return out_NHPD.transpose(1, 2).reshape(n * pad_len, q_SHD.shape[1], q_SHD.shape[2])


def _gqa(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict]:
    """GQA for SDPA on [N, H, P, D]: native enable_gqa on CPU (measured as fast or faster than
    repeating k/v), repeated k/v heads on CUDA so the fused flash/efficient kernels apply."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return k, v, {}
    if q.device.type == "cpu":
        return k, v, {"enable_gqa": True}
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), {}


@dataclasses.dataclass(frozen=True)
class SdpaMetadata:
    """The plan over the batch's segments (a shard's local pieces) and, for a ContextShard,
    the pieces whose document began before them in the row (their key prefix).

    prefixed: (flat query start, query length, flat key start, key length) of each such piece,
        over the local B*L/N queries and the gathered B*L keys; prefixed_query_index /
        prefixed_key_index: those spans' flat indices, concatenated.
    """

    plan: SdpaPlan
    prefixed: tuple[tuple[int, int, int, int], ...] = ()
    prefixed_query_index: Tensor | None = None
    prefixed_key_index: Tensor | None = None


class SdpaBackend(AttentionBackend):
    """Per-document SDPA. Context parallel: the local K/V serve every piece that starts its
    document (a whole document, a split one's head); the pieces whose document started
    earlier (under head-tail at most one per chunk; under documents the non-head pieces of
    split documents) are recomputed against the gathered keys and spliced in."""

    name = SDPA
    per_rank_key_spans = True

    def metadata(self, batch: PackedBatch) -> SdpaMetadata:
        plan = build_sdpa_plan(batch)
        if not isinstance(batch, ContextShard):
            return SdpaMetadata(plan)
        prefixed = tuple(s for s in piece_spans(batch) if s[1] != s[3])
        if not prefixed:
            return SdpaMetadata(plan)
        device = batch.tokens.device
        return SdpaMetadata(
            plan,
            prefixed,
            span_index([(s[0], s[1]) for s in prefixed]).to(device),
            span_index([(s[2], s[3]) for s in prefixed]).to(device),
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, data: SdpaMetadata) -> Tensor:
        return sdpa_attention(q, k, v, data.plan)

    def attend_row(self, q, k, v, k_row, v_row, data: SdpaMetadata) -> Tensor:
        return splice_prefixed_pieces(sdpa_attention(q, k, v, data.plan), q, k_row, v_row, data)


def splice_prefixed_pieces(
    out_local: Tensor, q: Tensor, k_row: Tensor, v_row: Tensor, data: SdpaMetadata
) -> Tensor:
    """Replace the outputs of pieces whose document began earlier by attention over their
    document's whole key span. out_local, q [B, L/N, H, D]; k_row, v_row [B, L, Hkv, D]."""
    if not data.prefixed:
        return out_local
    b, local_len, h, d = q.shape
    # one gather per tensor, then views: slicing each span out of the whole tensors would give
    # every span a full-size gradient buffer in backward
    q_lens, k_lens = [s[1] for s in data.prefixed], [s[3] for s in data.prefixed]
    q_spans = q.reshape(b * local_len, h, d).index_select(0, data.prefixed_query_index)
    k_spans, v_spans = (
        x.reshape(-1, *x.shape[2:]).index_select(0, data.prefixed_key_index).split(k_lens)
        for x in (k_row, v_row)
    )
    fixed = [
        lower_right_causal_attention(q_span, k_span, v_span)
        for q_span, k_span, v_span in zip(q_spans.split(q_lens), k_spans, v_spans, strict=True)
    ]
    flat = out_local.reshape(b * local_len, h, d)
    spliced = flat.index_copy(0, data.prefixed_query_index, torch.cat(fixed))
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
