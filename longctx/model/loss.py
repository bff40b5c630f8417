"""Chunked cross-entropy: never holds [N, V] fp32 logits, in forward or in backward.

Hidden states [N, dim] are cut into chunks of ``chunk_size`` tokens; each chunk's fp32 logits
are built, reduced to per-token losses and freed. When there are several chunks, each runs
under a non-reentrant checkpoint, so backward recomputes that chunk's logits instead of keeping
them: peak memory is one chunk's logits (and their gradient), not the whole batch's. A batch
that fits in one chunk is not checkpointed: backward would rebuild those same logits at its
start anyway, so recomputing them would cost an output projection and save no peak memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from longctx.batch import IGNORE_INDEX


def chunked_token_loss(
    hidden_ND: Tensor, weight_VD: Tensor, labels_N: Tensor, chunk_size: int
) -> Tensor:
    """fp32 [N] cross-entropy of each token; 0 where the label is IGNORE_INDEX."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}; expected a positive number of tokens")
    if hidden_ND.shape[0] <= chunk_size:
        return _chunk_loss(hidden_ND, weight_VD, labels_N)
    needs_grad = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)
    losses = []
    for start in range(0, hidden_ND.shape[0], chunk_size):
        h, y = hidden_ND[start : start + chunk_size], labels_N[start : start + chunk_size]
        if needs_grad:
            losses.append(checkpoint(_chunk_loss, h, weight_VD, y, use_reentrant=False))
        else:
            losses.append(_chunk_loss(h, weight_VD, y))
    return torch.cat(losses)


def _chunk_loss(h_CD: Tensor, weight_VD: Tensor, labels_C: Tensor) -> Tensor:
    logits_CV = F.linear(h_CD, weight_VD).float()  # fp32 softmax whatever the model dtype
    return F.cross_entropy(logits_CV, labels_C, ignore_index=IGNORE_INDEX, reduction="none")
