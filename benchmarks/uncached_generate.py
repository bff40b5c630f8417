"""Greedy generation without a KV cache: the reference that longctx's cached decoding is
benchmarked (bench_generate.py) and tested (tests/unit/test_kv_cache.py) against."""

from __future__ import annotations

import numpy as np
import torch

from longctx.batch import PackedBatch


@torch.no_grad()
def recompute_generate(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """The same greedy tokens without a cache: the whole sequence is run again for each new
    token (the reference the cache is tested and benchmarked against)."""
    device = model.tok_embeddings.weight.device
    ids = torch.as_tensor(np.asarray(prompt_ids), dtype=torch.int64)[None].to(device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        n = ids.shape[1]
        batch = PackedBatch.from_lengths(ids, [[n]], reset_position_ids=True)
        token = int(model(batch)[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return out
