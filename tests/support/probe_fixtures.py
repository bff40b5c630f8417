"""Rows and tiny transformers models the leak-probe tests share (unit tests and the CP script)."""

from __future__ import annotations

import torch
import transformers

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.probe.checks import ProbeRows

VOCAB = 64
L = 96
# a row of mixed documents, one of two, one of many short ones; pad tails of 3, 0 and 15 tokens
LENGTHS = [[5, 30, 1, 17, 40, 3], [60, 36], [11, 12, 13, 14, 15, 16, 15]]
PADS = [3, 0, 15]


def make_rows(reset: bool = True, lengths=LENGTHS, pads=PADS, seed: int = 0) -> ProbeRows:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (len(lengths), L), generator=gen)
    batch = PackedBatch.from_lengths(tokens, lengths, reset_position_ids=reset)
    for r, pad in enumerate(pads):
        if pad:
            batch.tokens[r, -pad:] = 0
            batch.labels[r, -pad:] = IGNORE_INDEX
    return ProbeRows(batch, list(pads), "rows")


def save_hf(family: str, folder, **sizes) -> str:
    """A seeded 2-layer ``family`` (llama, qwen2) causal LM of ``sizes`` saved in ``folder``."""
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    config = config_cls(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **sizes)
    model_cls(config).save_pretrained(folder)
    return str(folder)
