"""The Llama model over PackedBatch: config and presets, module, chunked loss, HF interop."""

from longctx.model.config import LlamaConfig
from longctx.model.flops import estimate_flops
from longctx.model.llama import Llama
from longctx.model.rope import RopeScaling

__all__ = ["Llama", "LlamaConfig", "RopeScaling", "estimate_flops"]
