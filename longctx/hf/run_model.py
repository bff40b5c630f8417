"""A trained run's Llama as export and verify read it: its config from the checkpoint's record,
its weights from the checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from longctx.model import Llama, LlamaConfig
from longctx.runs.record import StoredRun
from longctx.train.init_from import resolve

EXPORT_RECORD = "longctx_export.json"  # written into every export: where it came from


def llama_config(stored: StoredRun) -> LlamaConfig:
    """The run's model config from its checkpoint's record; only longctx's Llama exports."""
    config = stored.model_config()
    if not config.exports_to_hf:
        raise ValueError(
            f"{stored.checkpoint} was trained with {type(config).__name__}, not longctx's Llama; "
            "a model=hf run's weights are already a transformers model"
        )
    return config


def read_model(checkpoint: Path, config: LlamaConfig) -> Llama:
    """longctx's Llama with ``checkpoint``'s weights, on the CPU in fp32."""
    config = dataclasses.replace(config, init_from=str(checkpoint))
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    resolve(checkpoint).load_into(model)
    return model.eval()
