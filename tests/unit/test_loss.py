"""Chunked cross-entropy: the same per-token losses and gradients however it is chunked."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_scaled

from longctx.batch import IGNORE_INDEX
from longctx.model.loss import chunked_token_loss


@pytest.mark.parametrize("chunk_size", [1, 7, 50, 64, 1000])
def test_chunked_loss_equals_one_cross_entropy(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (64,))
    labels[::5] = IGNORE_INDEX
    losses = chunked_token_loss(hidden, weight, labels, chunk_size)
    grads = torch.autograd.grad(losses.sum(), (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, labels, ignore_index=IGNORE_INDEX, reduction="none")
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight))
    assert_close_scaled(losses, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close_scaled(g, r)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_token_loss(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4).long(), 0)
