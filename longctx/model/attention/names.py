"""Attention backend names: plain constants a config imports without importing any kernel."""

from __future__ import annotations

from longctx.errors import LongctxError

FLASH, FLEX, SDPA, EAGER = "flash", "flex", "sdpa", "eager"
AUTO = "auto"  # the best backend available on the device (longctx.model.attention.resolve_backend)
ATTENTION_BACKENDS = (FLASH, FLEX, SDPA, EAGER)


def check_backend_name(name: str) -> str:
    """The one check of a configured attn_backend: a backend name or "auto"."""
    if name not in ATTENTION_BACKENDS + (AUTO,):
        raise LongctxError(
            f"unknown attn_backend={name!r}; expected one of {ATTENTION_BACKENDS + (AUTO,)}"
        )
    return name
