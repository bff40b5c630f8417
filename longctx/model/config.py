"""Typed Llama configuration with named presets: the model spec that builds longctx's Llama.

Its fields and their checks are :class:`~longctx.model.settings.LlamaSettings`, which the module
and the FLOP count read; this class adds the presets and the building, so nothing below it needs
the config class that builds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from longctx.errors import LongctxError
from longctx.model.interface import check_weights
from longctx.model.llama import Llama
from longctx.model.settings import LlamaSettings


@dataclasses.dataclass
class LlamaConfig(LlamaSettings):
    """LlamaSettings as a model spec (longctx.model.interface.ModelSpec): built by name with
    overrides (:meth:`from_name`), and building the Llama it describes."""

    supports_context_parallel: ClassVar[bool] = True
    plans_capacity: ClassVar[bool] = True
    exports_to_hf: ClassVar[bool] = True

    def build(self):
        """Llama(self); on the meta device with ``init_from`` (configure_model shards it under
        FSDP2, materialises it and reads the weights, each rank its own shards)."""
        if self.init_from:
            with torch.device("meta"):
                return Llama(self)
        return Llama(self)

    def build_from(self, weights):
        """Llama(self) holding ``weights``: built on the meta device, checked, then assigned
        (memory-mapped tensors stay mapped)."""
        with torch.device("meta"):
            model = Llama(self)
        check_weights(model.state_dict(), weights)
        model.load_state_dict(weights, strict=True, assign=True)
        return model

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named preset ("tiny", "tiny_llama3", "llama3_1b", "llama3_8b") with field overrides (see
        :meth:`from_fields`)."""
        if name not in PRESETS:
            raise LongctxError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls.from_fields(PRESETS[name], **overrides)

    @classmethod
    def from_fields(cls, base: dict[str, Any], **overrides: Any) -> LlamaConfig:
        """``base`` (a preset, a checkpoint's config) with field overrides.

        An override of None keeps the base value (Hydra's yaml spells "not overridden" so);
        a ``rope_scaling`` dict is merged into the base's (``{"factor": 16}`` keeps its type
        and original length).
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise LongctxError(
                f"unknown LlamaConfig overrides {unknown}; fields are {sorted(fields)}"
            )
        merged = {**base, **{k: v for k, v in overrides.items() if v is not None}}
        if isinstance(overrides.get("rope_scaling"), dict):
            scaling = base.get("rope_scaling") or {}
            if dataclasses.is_dataclass(scaling):
                scaling = dataclasses.asdict(scaling)
            merged["rope_scaling"] = {**scaling, **overrides["rope_scaling"]}
        return cls(**merged)


# rope_scaling as a dict so that every config gets its own RopeScaling (from __post_init__).
PRESETS: dict[str, dict[str, Any]] = {
    # The CPU default: a few million parameters, byte-level vocabulary (256 bytes + specials).
    # With 512 logits per token a whole 128k-token row's fp32 logits are 256 MB: one loss
    # chunk, so the output projection is never recomputed.
    "tiny": dict(
        vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768,
        max_seq_len=131072, rope_theta=500000.0, loss_chunk_size=131072,
    ),
    # The tiny body with Llama 3's 128,256-id vocabulary (data.tokenizer=llama3): what the real
    # vocabulary costs on a CPU. Its two 128,256 x 256 tables are 66 M of its 69 M parameters;
    # a token's fp32 logits are 0.5 MB, so the loss runs in chunks of 1024 tokens (one chunk's logits, its
    # gradient and softmax: about 1.5 GB) whatever the row length.
    "tiny_llama3": dict(
        vocab_size=128256, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=768,
        max_seq_len=131072, rope_theta=500000.0, loss_chunk_size=1024,
    ),
    # Llama 3.2 1B.
    "llama3_1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        rope_theta=500000.0, rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192),
        tie_embeddings=True, max_seq_len=131072,
    ),
    # Llama 3.1 8B.
    "llama3_8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=500000.0, rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position=8192),
        tie_embeddings=False, max_seq_len=131072,
    ),
}  # fmt: skip
