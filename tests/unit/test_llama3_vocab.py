"""Llama 3's vocabulary in the model: the 8B dry run plans with 128,256 ids, a tokenizer with more
ids than the model holds is refused in one line, and the chunked loss never builds more than one
chunk's logits at 128k ids (forward and backward), in one buffer per step, while equal to the
unchunked loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST, compose
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longctx.batch import IGNORE_INDEX
from longctx.model import LlamaConfig
from longctx.model.loss import chunked_token_loss
from longctx.train.app import ConfigError, run

VOCAB = 128256


def test_the_8b_dry_run_plans_with_llama3s_vocabulary(tmp_path, capsys):
    overrides = [*FAST, "model=llama3_8b", "data.tokenizer=llama3", "data.seq_len=8192",
                 "data.micro_batch_size=1", "trainer=fsdp", "trainer.num_nodes=1",
                 "trainer.devices=8", "planner.device=H100", "dry_run=true"]  # fmt: skip
    report = run(compose(overrides, output_dir=tmp_path))
    out = capsys.readouterr().out
    assert "vocabulary: 128,256 ids (data.tokenizer=llama3: 128,256 ids)" in out
    assert report["model"]["vocab_size"] == VOCAB
    assert "1024-token chunk x vocab" in out or "-token chunk x vocab" in out
    assert not (tmp_path / "checkpoints").exists()


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path):
    cfg = compose([*FAST, "model=tiny", "data.tokenizer=llama3", "dry_run=true"], tmp_path)
    with pytest.raises(
        ConfigError, match=r"model.vocab_size=512: data.tokenizer=llama3 has 128,256"
    ):
        run(cfg)


def test_the_tiny_llama3_preset_is_tinys_body_with_128256_ids():
    tiny, big = LlamaConfig.from_name("tiny"), LlamaConfig.from_name("tiny_llama3")
    body = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len")
    assert all(getattr(tiny, f) == getattr(big, f) for f in body)
    assert big.vocab_size == VOCAB and big.loss_chunk_size == 1024


class FreshTensors(TorchDispatchMode):
    """Records the largest tensor any op returns, and each op that returns a fresh tensor (not
    a view, not an argument it wrote into: in-place and out= ops are mutable) of ``numel``
    elements or more."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.largest, self.fresh = numel, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.numel() >= self.numel and not (func._schema.is_mutable or func.is_view):
                    self.fresh.append(func)
        return out


def test_the_loss_allocates_one_chunks_logits_per_pass_at_128k_ids():
    """No tensor larger than one chunk's [chunk, V] logits exists, forward or backward, and
    each pass allocates that buffer once for its four chunks; the loss and gradients equal the
    unchunked cross-entropy's."""
    torch.manual_seed(0)
    tokens, dim, chunk = 1024, 16, 256
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = (torch.randn(VOCAB, dim) * 0.1).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,))
    labels[::7] = IGNORE_INDEX
    with FreshTensors(chunk * VOCAB) as forward:
        losses = chunked_token_loss(hidden, weight, labels, chunk)
    with FreshTensors(chunk * VOCAB) as backward:
        losses.sum().backward()
    assert forward.largest == backward.largest == chunk * VOCAB
    assert len(forward.fresh) == 1 and backward.fresh == []  # forward's buffer serves backward

    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    full = F.cross_entropy(F.linear(h2, w2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    full.sum().backward()
    scale = float(full.detach().abs().max())
    torch.testing.assert_close(losses, full, rtol=1e-5, atol=1e-6 * scale)
    for ours, theirs in ((hidden.grad, h2.grad), (weight.grad, w2.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()))
