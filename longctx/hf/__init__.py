"""Hugging Face interop in one package: checkpoint I/O for longctx's Llama (checkpoint.py) and any
HF causal LM trained on PackedBatch (adapter.py)."""

from longctx.hf.adapter import HFCausalLM, HFModelSpec, load_hf_causal_lm

__all__ = ["HFCausalLM", "HFModelSpec", "load_hf_causal_lm"]
