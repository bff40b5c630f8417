"""The `sdpa` backend: per-document causal SDPA, documents batched into length buckets.

No L x L mask exists anywhere. Every segment of the flattened B*L tokens is one document; the
documents are grouped so that a group runs as ONE ``scaled_dot_product_attention(is_causal=True)``
call on [n_docs, H, pad_len, D]. A shorter document in a group is padded at its END: under
causal masking its real queries never see the pad keys (they come later), and the pad queries'
outputs are dropped, so padding costs compute but never changes a result.

Grouping trades padding compute against one call per document (about 0.2 ms of fixed cost per
forward+backward SDPA call on CPU, roughly the compute of a 140-token causal block for the tiny
model's H=4, D=64). Documents are visited longest first; one joins the current group when its
padded area ``pad_len**2 - n**2`` stays under ``PAD_BUDGET_TOKENS2``, else it leads a new group.
Each joiner thus wastes at most one call's worth of compute, so the plan never costs more than
a loop of one call per document, and thousands of tiny documents collapse into a few calls.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from longctx.batch import PackedBatch

# Padding a document of n tokens up to pad_len costs ~(pad_len**2 - n**2) causal-attention
# token pairs; 128**2 is below one SDPA call's fixed cost on CPU (measured: ~0.2 ms fwd+bwd vs
# ~1e-8 s per token pair at H=4, D=64, 2 threads).
PAD_BUDGET_TOKENS2 = 128 * 128


@dataclasses.dataclass(frozen=True)
class DocBucket:
    """n_docs documents run as one SDPA call, each padded at its end to pad_len tokens.

    token_idx: int64 [n_docs * pad_len], the flat token (over B*L) behind every padded slot
    (pad slots repeat their document's last token); None when the bucket is one contiguous
    run of flat tokens starting at ``start`` (no copy needed, a view suffices).
    """

    pad_len: int
    n_docs: int
    start: int
    token_idx: Tensor | None


@dataclasses.dataclass(frozen=True)
class SdpaPlan:
    """Buckets covering every flat token once, and how to put their outputs back in order.

    unpad_idx: int64 [B*L], for each flat token its slot in cat(bucket outputs over
    [n_docs * pad_len] rows); None when that concatenation already is the flat order.
    """

    buckets: tuple[DocBucket, ...]
    unpad_idx: Tensor | None


def group_documents(lengths: list[int], pad_budget: int = PAD_BUDGET_TOKENS2) -> list[list[int]]:
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


def build_sdpa_plan(batch: PackedBatch, pad_budget: int = PAD_BUDGET_TOKENS2) -> SdpaPlan:
    """Bucket every segment of ``batch`` (flattened over B*L) and index the buckets' slots."""
    lengths = [n for n in batch.seq_lens.flatten().tolist() if n > 0]
    starts = torch.tensor(lengths, dtype=torch.int64).cumsum(0) - torch.tensor(lengths)
    total = sum(lengths)
    buckets, unpad_idx, slot_base = [], torch.empty(total, dtype=torch.int64), 0
    for group in group_documents(lengths, pad_budget):
        doc_len = torch.tensor([lengths[i] for i in group])
        doc_start = starts[group]
        pad_len = int(doc_len[0])
        offset_P = torch.arange(pad_len)
        # [n, P]: flat token per slot; pad slots repeat the document's last token
        token_idx_NP = doc_start[:, None] + torch.minimum(offset_P[None, :], doc_len[:, None] - 1)
        slot_NP = slot_base + torch.arange(len(group) * pad_len).view(len(group), pad_len)
        real_NP = offset_P[None, :] < doc_len[:, None]
        unpad_idx[token_idx_NP[real_NP]] = slot_NP[real_NP]
        buckets.append(_bucket(token_idx_NP, pad_len, doc_len))
        slot_base += len(group) * pad_len
    identity = slot_base == total and bool((unpad_idx == torch.arange(total)).all())
    return _to_device(SdpaPlan(tuple(buckets), None if identity else unpad_idx), batch)


def _bucket(token_idx_NP: Tensor, pad_len: int, doc_len: Tensor) -> DocBucket:
    n, start = token_idx_NP.shape[0], int(token_idx_NP[0, 0])
    flat = token_idx_NP.flatten()
    contiguous = bool((doc_len == pad_len).all()) and bool(
        (flat == torch.arange(start, start + flat.numel())).all()
    )
    return DocBucket(pad_len, n, start, None if contiguous else flat)


def _to_device(plan: SdpaPlan, batch: PackedBatch) -> SdpaPlan:
    device = batch.tokens.device
    buckets = tuple(
        dataclasses.replace(b, token_idx=None if b.token_idx is None else b.token_idx.to(device))
        for b in plan.buckets
    )
    unpad = None if plan.unpad_idx is None else plan.unpad_idx.to(device)
    return SdpaPlan(buckets, unpad)


# --------------------------------------------------------------------------- forward
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, plan: SdpaPlan) -> Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D], causal within each document."""
    b, length, h, d = q.shape
    q_THD = q.reshape(b * length, h, d)  # T = B*L flat tokens
    k_THD = k.reshape(b * length, k.shape[2], d)
    v_THD = v.reshape(b * length, k.shape[2], d)
    outs = [_bucket_attention(q_THD, k_THD, v_THD, bucket) for bucket in plan.buckets]
    out_THD = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.unpad_idx is not None:
        out_THD = out_THD.index_select(0, plan.unpad_idx)
    return out_THD.view(b, length, h, d)


def _bucket_attention(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, bucket: DocBucket) -> Tensor:
    """One SDPA call over a bucket; returns [n_docs * pad_len, H, D] in slot order."""
    n, pad_len = bucket.n_docs, bucket.pad_len
    q_NHPD, k_NHPD, v_NHPD = (_take(x, bucket).transpose(1, 2) for x in (q_THD, k_THD, v_THD))
    k_NHPD, v_NHPD, gqa_kwargs = _gqa(q_NHPD, k_NHPD, v_NHPD)
    out_NHPD = F.scaled_dot_product_attention(q_NHPD, k_NHPD, v_NHPD, is_causal=True, **gqa_kwargs)
    return out_NHPD.transpose(1, 2).reshape(n * pad_len, q_THD.shape[1], q_THD.shape[2])


def _take(x_THD: Tensor, bucket: DocBucket) -> Tensor:
    """[n_docs, pad_len, H, D] slots of a bucket: a view when contiguous, else a gather."""
    n, pad_len = bucket.n_docs, bucket.pad_len
    if bucket.token_idx is None:
        rows = x_THD.narrow(0, bucket.start, n * pad_len)
    else:
        rows = x_THD.index_select(0, bucket.token_idx)
    return rows.view(n, pad_len, x_THD.shape[1], x_THD.shape[2])


def _gqa(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, dict]:
    """GQA for SDPA on [N, H, P, D]: native enable_gqa on CPU (measured as fast or faster than
    repeating k/v), repeated k/v heads on CUDA so the fused flash/efficient kernels apply."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return k, v, {}
    if q.device.type == "cpu":
        return k, v, {"enable_gqa": True}
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), {}
