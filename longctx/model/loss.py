"""Chunked linear cross-entropy: one chunk's logits at a time, in one buffer reused by every chunk.

Hidden states [N, dim] are cut into chunks of ``chunk_size`` tokens. Forward computes each
chunk's logits into a [chunk, V] buffer allocated once, reduces them in place to each token's
log-sum-exp and loss, and saves for backward only the inputs and the [N] log-sum-exp. Backward
refills the same buffer with each chunk's logits, turns them in place into their gradient
(softmax minus one-hot, times the token's upstream gradient) and adds the hidden states' and the
weight's gradients into outputs allocated once. Why one buffer rather than checkpointing each
chunk (as this module did): autograd allocated fresh [chunk, V] tensors for every chunk's
forward and recompute, and under train.py's CPU allocator setting (``retain_freed_memory``, which
keeps freed heap blocks) they did not reuse each other's memory, so the footprint grew with the
number of chunks (benchmarks/bench_vocab.py). With one buffer the peak is one chunk's logits
however many chunks there are and whatever the allocator keeps.

Precision: the matmuls run in the inputs' dtype (the autocast dtype under autocast), as F.linear
would; a bf16/fp16 product is upcast into the buffer, which is fp32 (fp64 for fp64 inputs), so the
softmax, log-sum-exp and losses are fp32. Computing the logits in fp32 instead would need an fp32
copy of the [V, dim] weight (2 GiB for Llama 3 8B, the size of a 4,096-token chunk's buffer) and
fp32 matmuls. The logits' gradient is rounded back to the compute dtype for the two backward
matmuls, and the gradients accumulate in that dtype, as autograd's sum over chunks of
``F.linear(h, w).float()`` did; a compute dtype other than fp32 adds one [chunk, V] buffer in it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX


def chunked_token_loss(
    hidden_ND: Tensor, weight_VD: Tensor, labels_N: Tensor, chunk_size: int
) -> Tensor:
    """fp32 [N] cross-entropy of each token; 0 where the label is IGNORE_INDEX."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}; expected a positive number of tokens")
    device = hidden_ND.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(hidden_ND.dtype, weight_VD.dtype)
    h_ND, w_VD = hidden_ND.to(dtype), weight_VD.to(dtype)  # autograd casts the gradients back
    with torch.autocast(device, enabled=False):  # the inputs are in the compute dtype already
        if torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad):
            return _LinearCrossEntropy.apply(h_ND, w_VD, labels_N, chunk_size)
        return _forward(h_ND, w_VD, labels_N, chunk_size)[0]  # no graph: nothing is saved


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, chunk: int) -> Tensor:
        # scratch, not logits: backward refills it. The loss's backward follows its forward, so
        # keeping it costs no peak, and freeing it in between let glibc's retained heap split the
        # freed block with small allocations, so that backward's buffer took fresh memory
        ctx.buffers = _buffers(h_ND, w_VD, chunk)
        losses_N, lse_N = _forward(h_ND, w_VD, labels_N, chunk, ctx.buffers)
        ctx.save_for_backward(h_ND, w_VD, labels_N, lse_N)
        ctx.chunk = chunk
        return losses_N

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        h_ND, w_VD, labels_N, lse_N = ctx.saved_tensors
        logits, low = ctx.buffers or _buffers(h_ND, w_VD, ctx.chunk)  # None: a second backward
        ctx.buffers = None  # the graph (and this ctx) can outlive backward: do not hold them
        want_h, want_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h_ND) if want_h else None
        grad_w = torch.zeros_like(w_VD) if want_w else None
        ignored_N, targets_N1 = _targets(labels_N)
        scale_N1 = grad_N.to(lse_N.dtype).masked_fill(ignored_N, 0).unsqueeze(1)
        with torch.autocast(h_ND.device.type, enabled=False):
            for s in range(0, h_ND.shape[0], ctx.chunk):
                h_CD, e = h_ND[s : s + ctx.chunk], s + ctx.chunk
                g_CV = _logits_into(logits, low, h_CD, w_VD).sub_(lse_N[s:e, None]).exp_()
                g_CV.scatter_add_(1, targets_N1[s:e], g_CV.new_full(targets_N1[s:e].shape, -1))
                g_CV.mul_(scale_N1[s:e])  # 0 on ignored rows
                if low is not logits:
                    g_CV = low[: len(h_CD)].copy_(g_CV)
                if want_h:
                    torch.mm(g_CV, w_VD, out=grad_h[s:e])
                if want_w:
                    grad_w.addmm_(g_CV.T, h_CD)
        return grad_h, grad_w, None, None


def _forward(
    h_ND: Tensor, w_VD: Tensor, labels_N: Tensor, chunk: int, buffers=None
) -> tuple[Tensor, Tensor]:
    """Per-token losses (0 at IGNORE_INDEX) and log-sum-exp of the logits, both [N]."""
    logits, low = buffers or _buffers(h_ND, w_VD, chunk)
    lse_N = logits.new_empty(h_ND.shape[0])
    losses_N = torch.empty_like(lse_N)
    ignored_N, targets_N1 = _targets(labels_N)
    for s in range(0, h_ND.shape[0], chunk):
        x_CV, e = _logits_into(logits, low, h_ND[s : s + chunk], w_VD), s + chunk
        target_C = x_CV.gather(1, targets_N1[s:e]).squeeze(1)
        max_C = x_CV.amax(dim=1)
        # exp in place: forward needs these logits no more
        lse_N[s:e] = x_CV.sub_(max_C[:, None]).exp_().sum(dim=1).log_().add_(max_C)
        losses_N[s:e] = (lse_N[s:e] - target_C).masked_fill_(ignored_N[s:e], 0)
    return losses_N, lse_N


def _targets(labels_N: Tensor) -> tuple[Tensor, Tensor]:
    """Where the label is IGNORE_INDEX, and the labels as [N, 1] gather indices (0 there)."""
    ignored_N = labels_N == IGNORE_INDEX
    return ignored_N, labels_N.masked_fill(ignored_N, 0).unsqueeze(1)


def _buffers(h_ND: Tensor, w_VD: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """The pass's [chunk, V] softmax buffer (fp32, or fp64), and the compute dtype's one for
    the matmuls: the same tensor when the dtypes agree."""
    shape = (min(chunk, h_ND.shape[0]), w_VD.shape[0])
    logits = h_ND.new_empty(shape, dtype=torch.promote_types(h_ND.dtype, torch.float32))
    return logits, (logits if logits.dtype == h_ND.dtype else h_ND.new_empty(shape))


def _logits_into(logits: Tensor, low: Tensor, h_CD: Tensor, w_VD: Tensor) -> Tensor:
    """h @ w.T in h's dtype, in the first rows of ``logits`` (upcast through ``low``)."""
    rows = h_CD.shape[0]
    torch.mm(h_CD, w_VD.T, out=low[:rows])
    return logits[:rows] if low is logits else logits[:rows].copy_(low[:rows])
