"""Run folders for the export tests: the saved Hydra config and a checkpoint of a small random
Llama built from it, in the layouts train.py writes (a .ckpt file or a sharded folder)."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import CACHE_DIR, compose
from hydra.utils import instantiate
from omegaconf import OmegaConf

from longctx.model import Llama

# tests/module_fixtures.SMALL with room for the byte tokenizer's 259 ids
SHAPES = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300)
YARN = "{type: yarn, factor: 4, original_max_position: 32}"


def model_overrides(rope_scaling: str | None = YARN, **shapes) -> list[str]:
    fields = {**SHAPES, **shapes, "attn_backend": "sdpa"}
    scaling = [f"model.rope_scaling={rope_scaling}"] if rope_scaling else []
    return ["model=tiny", *(f"++model.{k}={v}" for k, v in fields.items()), *scaling]


def make_run(
    root: Path,
    overrides: list[str] | None = None,
    seq_len: int = 64,
    seed: int = 5,
    sharded: bool = False,
) -> Path:
    """root/run with .hydra/config.yaml and checkpoints/last.ckpt (a folder when ``sharded``)."""
    run = root / "run"
    cfg = compose(
        (overrides or model_overrides())
        + [f"data.seq_len={seq_len}", f"paths.cache_dir={CACHE_DIR}"],
        output_dir=run,
    )
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    torch.manual_seed(seed)
    model = Llama(instantiate(cfg.model))
    state = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    ckpt = run / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    if sharded:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(ckpt))  # the layout Lightning's FSDP2 strategy writes
    else:
        torch.save(state, ckpt)
    return run
