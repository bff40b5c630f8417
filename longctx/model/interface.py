"""The one interface of every model over PackedBatch (longctx's Llama, the HF adapter).

A model supplies its final-normed hidden states, its output projection and its FLOPs; the logits,
the per-token loss and the loss sum are computed here, once, for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.errors import LongctxError
from longctx.model.loss import chunked_token_loss


class ModelSpec(Protocol):
    """What the app, the LightningModule, the planner and the record ask of a model's config:
    longctx's :class:`~longctx.model.config.LlamaConfig` and the Hugging Face adapter's
    ``HFModelSpec`` both implement it, so nothing needs to ask which one it has."""

    attn_backend: str
    # the model can take a row split over context-parallel ranks
    supports_context_parallel: ClassVar[bool]
    # longctx.planner models this model's memory and step time
    plans_capacity: ClassVar[bool]
    # longctx.hf.export writes it as a transformers folder
    exports_to_hf: ClassVar[bool]

    @property
    def init_from(self) -> str | None:
        """Weights to start from (read when the model is configured), or None."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_seq_len(self) -> int:
        """The longest row the model is configured for."""

    def num_params(self) -> int: ...

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse rows of ``seq_len`` the model cannot run correctly, saying why."""

    def build(self) -> PackedCausalLM:
        """The model (on the meta device when ``init_from`` will fill it)."""

    def build_from(self, weights: Mapping[str, Tensor]) -> PackedCausalLM:
        """The model holding ``weights`` (a checkpoint's state dict, memory-mapped, named as the
        model's), refused by :func:`check_weights` before the model is allocated."""


class PackedCausalLM(nn.Module):
    """Base of the models the LightningModule, the evaluation and the app run."""

    loss_chunk_size: int  # tokens per chunk of the chunked cross-entropy

    def hidden_states(self, batch: PackedBatch) -> Tensor:
        """Final-normed hidden states [B, L, dim]."""
        raise NotImplementedError

    @property
    def output_weight(self) -> Tensor:
        """[V, dim] projection from hidden states to logits."""
        raise NotImplementedError

    def estimate_flops(self, seq_lens: Tensor) -> float:
        """Forward + backward FLOPs of a batch with per-row segment lengths ``seq_lens``."""
        raise NotImplementedError

    def forward(self, batch: PackedBatch) -> Tensor:
        """Logits [B, L, V] (full: for evaluation and tests at small L)."""
        return F.linear(self.hidden_states(batch), self.output_weight)

    def labelled_logits(self, batch: PackedBatch) -> Tensor:
        """Logits [labelled tokens, V] at the positions with a label, row-major (teacher-forced
        scoring): no [B, L, V] tensor at long L. A method of its own so FSDP2 can run it
        under the root's hooks (longctx.distributed.fsdp.FORWARD_METHODS)."""
        mask = batch.labels != IGNORE_INDEX
        return F.linear(self.hidden_states(batch)[mask], self.output_weight)

    def token_loss(self, batch: PackedBatch) -> Tensor:
        """fp32 [B, L] cross-entropy per token, 0 where label == -100; chunked over tokens."""
        h_ND = self.hidden_states(batch).flatten(0, 1)
        losses_N = chunked_token_loss(
            h_ND, self.output_weight, batch.labels.flatten(), self.loss_chunk_size
        )
        return losses_N.view(batch.shape)

    def loss(self, batch: PackedBatch) -> tuple[Tensor, int]:
        """(fp32 loss summed over target tokens, number of target tokens).

        A sum, not a mean: the caller divides by the global number of target tokens so the
        loss is the same however tokens are split into rows, micro-batches or ranks.
        """
        return self.token_loss(batch).sum(), batch.num_loss_tokens


def check_weights(expected: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> None:
    """Refuse ``weights`` whose names or shapes differ from ``expected`` (a model's state dict,
    on the meta device), naming the first few: a config that does not fit a checkpoint."""
    missing, unexpected = (
        sorted(expected.keys() - weights.keys()),
        sorted(weights.keys() - expected.keys()),
    )
    if missing or unexpected:
        raise LongctxError(
            f"the checkpoint's tensors are not the model's: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
            f"{' ...' if len(unexpected) > 3 else ''}"
        )
    wrong = [k for k in expected if tuple(expected[k].shape) != tuple(weights[k].shape)]
    if wrong:
        shapes = "; ".join(
            f"{k}: model {tuple(expected[k].shape)} vs checkpoint {tuple(weights[k].shape)}"
            for k in wrong[:3]
        )
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise LongctxError(f"tensor shapes differ from the model config's: {shapes}{more}")


def check_batch(
    batch: PackedBatch, device: torch.device, vocab_size: int, max_positions: int | None
) -> None:
    """The batch is on the model's device and its ids index inside the embedding and RoPE
    tables (out-of-range ids would index past them: name them instead)."""
    if batch.tokens.device != device:
        raise ValueError(
            f"batch is on {batch.tokens.device} but the model is on {device}; "
            "move it with batch.to(device)"
        )
    bounds = [batch.tokens.min(), batch.tokens.max()]
    bounds += [batch.position_ids.min(), batch.position_ids.max()]
    tok_min, tok_max, pos_min, pos_max = torch.stack(bounds).tolist()  # one device sync
    if tok_min < 0 or tok_max >= vocab_size:
        raise LongctxError(
            f"token ids span [{tok_min}, {tok_max}]; expected ids in [0, vocab_size={vocab_size})"
        )
    if pos_min < 0 or (max_positions is not None and pos_max >= max_positions):
        raise LongctxError(
            f"position ids span [{pos_min}, {pos_max}]; expected positions in "
            f"[0, max_seq_len={max_positions})"
        )
