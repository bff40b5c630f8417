"""Greedy generation with longctx's Llama: prefill the prompt, then one token at a time from the
KV cache (:meth:`Llama.prefill`, :meth:`Llama.decode`).

    ids = greedy_generate(model, prompt_ids, max_new_tokens=32, stop_ids=[eos_id])

``generate_from_batch`` is the general form: prompts as PackedBatch rows (one prompt per row,
or a context-parallel shard of such rows), each continued greedily; every row of the batch
advances together, so the prompts of one call share a length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from longctx.batch import PackedBatch
from longctx.errors import LongctxError


def greedy_generate(
    model, prompt_ids: Sequence[int] | np.ndarray | Tensor, max_new_tokens: int, stop_ids=None
) -> list[int]:
    """The greedy continuation of one prompt (a 1-D sequence of token ids), without the stop
    token that ended it (if any)."""
    prompt = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.int64)
    if prompt.ndim != 1 or prompt.numel() == 0:
        raise LongctxError(
            f"prompt_ids has shape {tuple(prompt.shape)}; expected one non-empty row"
        )
    return greedy_generate_batch(model, prompt[None], max_new_tokens, stop_ids)[0]


def greedy_generate_batch(
    model, prompts_BN: Tensor | np.ndarray, max_new_tokens: int, stop_ids=None
) -> list[list[int]]:
    """The greedy continuations of B prompts of one length N ([B, N] ids), each a document
    with positions 0 .. N-1."""
    prompts = torch.as_tensor(np.asarray(prompts_BN), dtype=torch.int64)
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise LongctxError(
            f"prompts have shape {tuple(prompts.shape)}; expected [B, N] with N >= 1"
        )
    device = model.tok_embeddings.weight.device
    b, n = prompts.shape
    batch = PackedBatch.from_lengths(prompts, [[n]] * b, reset_position_ids=True).to(device)
    return generate_from_batch(model, batch, max_new_tokens, stop_ids)


@torch.no_grad()
def generate_from_batch(
    model, batch: PackedBatch, max_new_tokens: int, stop_ids: Iterable[int] | None = None
) -> list[list[int]]:
    """Greedy continuation of every row's last segment, up to ``max_new_tokens`` tokens or a
    token of ``stop_ids`` (not returned). ``batch`` may be a ContextShard: the prompt is
    prefilled under context parallelism and every rank of the group decodes the same tokens."""
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise LongctxError(f"max_new_tokens={max_new_tokens!r}; expected an int >= 1")
    row_len = batch.row_len
    logits_BV, cache = model.prefill(batch, capacity=row_len + max_new_tokens)
    stop = torch.tensor(sorted(set(stop_ids or ())), dtype=torch.int64, device=logits_BV.device)
    generated: list[Tensor] = []
    done = torch.zeros(logits_BV.shape[0], dtype=torch.bool, device=logits_BV.device)
    for step in range(max_new_tokens):
        next_B = logits_BV.argmax(-1)
        generated.append(next_B)
        done |= torch.isin(next_B, stop)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits_BV = model.decode(next_B[:, None], cache)[:, -1]
    return [_until_stop(row, stop) for row in torch.stack(generated, 1).tolist()]


def _until_stop(ids: list[int], stop: Tensor) -> list[int]:
    stops = set(stop.tolist())
    for i, token in enumerate(ids):
        if token in stops:
            return ids[:i]
    return ids
