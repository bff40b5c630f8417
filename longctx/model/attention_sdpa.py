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

from longctx.batch import PackedBatch

# Token pairs of padding worth one SDPA fwd+bwd call. CPU, measured at H=4, D=64, 1 thread:
# a call costs ~0.07 ms + 1.3 us/token + 5e-8 s/token pair, so ~1400 pairs; 32**2 measured best
# on 8k rows of tiny documents. CUDA: a call is ~0.1 ms of launches while a token pair costs
# ~1e-10 s at the 8B shape, so padding is far cheaper there (an estimate; benchmarks/gpu_bench.py
# times several budgets).
PAD_BUDGET_TOKENS2 = {"cpu": 32 * 32, "cuda": 512 * 512}


@dataclasses.dataclass(frozen=True)
class SdpaPlan:
    """Document buckets over the flattened B*L tokens, as slots of one padded token list.

    bucket_shapes: (n_docs, pad_len) per bucket, the bucket's SDPA batch and length; bucket i
        owns the next n_docs * pad_len slots, document-major.
    slot_token_idx: int64 [num_slots], the flat token behind every slot (pad slots repeat
        their document's last token); None when the slots are exactly the flat tokens.
    unpad_idx: int64 [B*L], the slot of every flat token; None when that is the identity.

    One gather in, one scatter out: gradients then flow through a single index_select and a
    single split (whose backward is one cat), never through a full-size zero tensor per bucket.
    """

    bucket_shapes: tuple[tuple[int, int], ...]
    slot_token_idx: Tensor | None
    unpad_idx: Tensor | None

    @property
    def num_slots(self) -> int:
        return sum(n * pad_len for n, pad_len in self.bucket_shapes)


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
    len_D = torch.tensor(lengths, dtype=torch.int64)  # D = documents (segments)
    start_D = len_D.cumsum(0) - len_D
    shapes, token_idx, real = [], [], []
    for group in group_documents(lengths, pad_budget):
        doc_len_N, pad_len = len_D[group], lengths[group[0]]
        offset_NP = torch.arange(pad_len).expand(len(group), pad_len)
        last_N1 = (doc_len_N - 1)[:, None]
        token_idx.append((start_D[group][:, None] + offset_NP.minimum(last_N1)).flatten())
        real.append((offset_NP <= last_N1).flatten())
        shapes.append((len(group), pad_len))
    slot_token_idx, real_slot = torch.cat(token_idx), torch.cat(real)
    unpad_idx = torch.empty(len(len_D) and int(len_D.sum()), dtype=torch.int64)
    unpad_idx[slot_token_idx[real_slot]] = real_slot.nonzero().flatten()
    device = batch.tokens.device
    no_pad = slot_token_idx.numel() == unpad_idx.numel()
    return SdpaPlan(
        tuple(shapes),
        None if no_pad and _is_identity(slot_token_idx) else slot_token_idx.to(device),
        None if no_pad and _is_identity(unpad_idx) else unpad_idx.to(device),
    )


def _is_identity(idx: Tensor) -> bool:
    return bool((idx == torch.arange(idx.numel())).all())


# --------------------------------------------------------------------------- forward
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, plan: SdpaPlan) -> Tensor:
    """q [B, L, H, D], k/v [B, L, Hkv, D] -> [B, L, H, D], causal within each document."""
    b, length, h, d = q.shape
    sizes = [n * pad_len for n, pad_len in plan.bucket_shapes]
    q_pieces, k_pieces, v_pieces = (_slots(x, plan).split(sizes) for x in (q, k, v))
    outs = []
    for shape, q_SHD, k_SHD, v_SHD in zip(
        plan.bucket_shapes, q_pieces, k_pieces, v_pieces, strict=True
    ):
        outs.append(_bucket_attention(q_SHD, k_SHD, v_SHD, *shape))  # S = this bucket's slots
    out_SHD = outs[0] if len(outs) == 1 else torch.cat(outs)
    if plan.unpad_idx is not None:
        out_SHD = out_SHD.index_select(0, plan.unpad_idx)
    return out_SHD.view(b, length, h, d)


def _slots(x_BLHD: Tensor, plan: SdpaPlan) -> Tensor:
    """[num_slots, H, D]: the flat tokens gathered into bucket slot order."""
    x_THD = x_BLHD.reshape(-1, x_BLHD.shape[2], x_BLHD.shape[3])  # T = B*L flat tokens
    return x_THD if plan.slot_token_idx is None else x_THD.index_select(0, plan.slot_token_idx)


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
