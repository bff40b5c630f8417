"""Small modules and packed batches for trainer-level tests (shared with the DDP script)."""

from __future__ import annotations

from functools import partial

import lightning as L
import torch

from longctx import PackedBatch
from longctx.model import LlamaConfig
from longctx.train.module import LongCtxModule
from longctx.train.optim_config import OptimConfig

# the small model of the tests: every test that needs another shape overrides fields of this one
SMALL = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, attn_backend="sdpa"
)


def small_fields(**overrides) -> dict:
    """SMALL with ``overrides`` (a field set to None is dropped: the config's default)."""
    return {k: v for k, v in {**SMALL, **overrides}.items() if v is not None}


def small_module(
    accumulate: int = 1,
    lr: float = 0.1,
    seed: int = 0,
    compile: bool = False,
    init_from: str | None = None,
) -> LongCtxModule:
    torch.manual_seed(seed)
    config = LlamaConfig.from_name("tiny", **SMALL, init_from=init_from)
    # SGD, not Adam: Adam's first step is invariant to the gradient's scale and nearly to its
    # direction, so it would hide a wrong loss normalisation
    return LongCtxModule(
        config,
        OptimConfig(
            partial(torch.optim.SGD, lr=lr), grad_clip=None, accumulate_grad_batches=accumulate
        ),
        compile=compile,
    )


def random_batch(seed: int, rows: list[list[int]], length: int, reset: bool = True) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SMALL["vocab_size"], (len(rows), length), generator=g)
    return PackedBatch.from_lengths(tokens, rows, reset_position_ids=reset)


def cat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """Stack the rows of several batches (same L) into one batch."""
    width = max(b.seq_lens.shape[1] for b in batches)
    pad = [torch.nn.functional.pad(b.seq_lens, (0, width - b.seq_lens.shape[1])) for b in batches]
    return PackedBatch(
        torch.cat([b.tokens for b in batches]),
        torch.cat([b.labels for b in batches]),
        torch.cat([b.position_ids for b in batches]),
        torch.cat(pad),
    )


def fit(module: LongCtxModule, batches: list[PackedBatch], max_steps: int, **trainer_kwargs):
    loader = torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=loader)
    return trainer
