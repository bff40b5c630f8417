"""Hugging Face interop in one package: checkpoint I/O for longctx's Llama (checkpoint.py), any
HF causal LM trained on PackedBatch (adapter.py), and feature conversion (features.py)."""

from longctx.hf.adapter import HFCausalLM, HFModelSpec, load_hf_causal_lm
from longctx.hf.features import from_features, to_hf_kwargs

__all__ = ["HFCausalLM", "HFModelSpec", "from_features", "load_hf_causal_lm", "to_hf_kwargs"]
