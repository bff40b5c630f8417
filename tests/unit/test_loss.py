"""Chunked linear cross-entropy: the losses and gradients of F.cross_entropy(F.linear(h, w))
however it is chunked, with ignored labels, any upstream gradient and low-precision inputs."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_scaled

from longctx.batch import IGNORE_INDEX
from longctx.model.loss import chunked_token_loss


def inputs(n=64, dim=16, vocab=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = IGNORE_INDEX
    upstream = torch.rand(n, generator=g) * 3  # not all ones: each token's own scale
    return hidden, weight, labels, upstream


def losses_and_grads(loss_fn, hidden, weight, labels, upstream):
    losses = loss_fn(hidden, weight, labels)
    return (losses.detach(), *torch.autograd.grad((losses * upstream).sum(), (hidden, weight)))


def reference(hidden, weight, labels):
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


# 64 tokens: 64 chunks of 1, chunks of 7 (the last of 1), 50 (the last of 14), one exact chunk,
# one chunk larger than the batch
@pytest.mark.parametrize("chunk_size", [1, 7, 50, 64, 1000])
def test_chunked_loss_equals_one_cross_entropy(chunk_size):
    hidden, weight, labels, upstream = inputs()
    ours = losses_and_grads(
        lambda h, w, y: chunked_token_loss(h, w, y, chunk_size), hidden, weight, labels, upstream
    )
    theirs = losses_and_grads(reference, hidden, weight, labels, upstream)
    assert ours[0].dtype == torch.float32
    assert (ours[0][labels == IGNORE_INDEX] == 0).all()
    for a, b in zip(ours, theirs, strict=True):
        assert_close_scaled(a, b)


def test_gradients_pass_gradcheck_in_float64():
    hidden, weight, labels, _ = inputs(n=7, dim=3, vocab=5, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_token_loss(h, w, labels, 3), (hidden, weight), eps=1e-6, atol=1e-5
    )


def test_ignored_tokens_have_no_loss_and_no_gradient():
    hidden, weight, labels, upstream = inputs(n=12)
    labels[:8] = IGNORE_INDEX  # the first two chunks of 4 are wholly ignored
    losses, grad_h, grad_w = losses_and_grads(
        lambda h, w, y: chunked_token_loss(h, w, y, 4), hidden, weight, labels, upstream
    )
    assert (losses[:8] == 0).all() and (grad_h[:8] == 0).all()
    assert_close_scaled(grad_w, losses_and_grads(reference, hidden, weight, labels, upstream)[2])

    labels[:] = IGNORE_INDEX
    losses, grad_h, grad_w = losses_and_grads(
        lambda h, w, y: chunked_token_loss(h, w, y, 4), hidden, weight, labels, upstream
    )
    assert not losses.any() and not grad_h.any() and not grad_w.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_match_the_reference_in_their_dtype(dtype):
    """bf16/fp16 matmuls (the logits rounded to the dtype, as F.linear's), an fp32 softmax; the
    weight's gradient is summed over chunks in the dtype, so it is compared to a few roundings."""
    hidden, weight, labels, upstream = inputs(dtype=dtype)
    ours = losses_and_grads(
        lambda h, w, y: chunked_token_loss(h, w, y, 16), hidden, weight, labels, upstream
    )
    theirs = losses_and_grads(reference, hidden, weight, labels, upstream)
    assert ours[0].dtype == torch.float32
    assert ours[1].dtype == ours[2].dtype == dtype
    assert_close_scaled(ours[0], theirs[0])  # the same rounded logits, then fp32
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert_close_scaled(a.float(), b.float(), rel=2e-2)


def test_under_autocast_the_matmuls_run_in_its_dtype():
    hidden, weight, labels, upstream = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = losses_and_grads(
            lambda h, w, y: chunked_token_loss(h, w, y, 16), hidden, weight, labels, upstream
        )
    bf16 = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight)]
    theirs = losses_and_grads(reference, *bf16, labels, upstream)
    assert ours[1].dtype == ours[2].dtype == torch.float32  # cast back to the fp32 inputs'
    assert_close_scaled(ours[0], theirs[0])
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        assert_close_scaled(a, b.float(), rel=2e-2)


def test_only_the_gradients_asked_for_are_computed():
    hidden, weight, labels, upstream = inputs()
    frozen = weight.detach()
    losses = chunked_token_loss(hidden, frozen, labels, 16)
    (grad_h,) = torch.autograd.grad((losses * upstream).sum(), hidden)
    assert_close_scaled(grad_h, losses_and_grads(reference, hidden, weight, labels, upstream)[1])
    assert frozen.grad is None


def test_nothing_is_saved_for_backward_without_grad():
    hidden, weight, labels, _ = inputs()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            losses = chunked_token_loss(hidden, weight, labels, 16)
        assert losses.grad_fn is None and not saved
        chunked_token_loss(hidden, weight, labels, 16)
    assert saved  # with grad the inputs and the log-sum-exp are saved: the hook does see them


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_must_be_positive(chunk_size):
    with pytest.raises(ValueError, match=f"chunk_size={chunk_size}"):
        chunked_token_loss(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4).long(), chunk_size)
