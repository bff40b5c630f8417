"""The context length an export states: what the run trained at, or what its RoPE scaling reaches.

The rule (config.json's ``max_position_embeddings``, and the tokenizer's ``model_max_length``):

    max_position_embeddings = min(max(trained, reach), model.max_seq_len)

- ``trained``: the longest rows the run trained on, the largest ``seq_len`` of its data stages
  (the last stage's is ``data.seq_len``);
- ``reach``: for ``yarn`` and ``llama3``, ``original_max_position x factor``, the length the
  scaling is configured for (transformers' YaRN check expects exactly this ratio); ``linear``
  and no scaling state no reach of their own (transformers' linear dict has no original
  length), so their length is the trained one;
- ``model.max_seq_len``: the preset's RoPE range, the most longctx's own model accepts.

Tools size themselves by it: lm-eval's rolling windows, vLLM's KV cache and its refusal of
longer prompts, transformers' truncation.
"""

from __future__ import annotations

from longctx.model import LlamaConfig

# RoPE scalings whose transformers dict names the length they extend from
_REACHING = ("yarn", "llama3")


def trained_length(data_config) -> int:
    """The longest rows the run trained on: ``seq_len`` of its last stage or any earlier one."""
    stages = getattr(data_config, "stages", None) or []
    return max([int(data_config.seq_len), *(int(s.seq_len) for s in stages)])


def max_positions(model_config: LlamaConfig, trained: int) -> int:
    """config.json's ``max_position_embeddings``: the module docstring's rule."""
    scaling = model_config.rope_scaling
    reaches = scaling is not None and scaling.type in _REACHING
    reach = int(round(scaling.original_max_position * scaling.factor)) if reaches else 0
    return min(max(trained, reach), model_config.max_seq_len)
