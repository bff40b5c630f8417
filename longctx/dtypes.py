"""Floating-point dtypes by the names configs use: the one table every config that names a
dtype reads (the HF adapter's weights, FSDP's mixed precision)."""

from __future__ import annotations

import torch

from longctx.errors import LongctxError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_named(name: str, what: str = "dtype") -> torch.dtype:
    """The torch dtype a config names; ``what`` names the config key in the error."""
    if name not in DTYPES:
        raise LongctxError(f"{what}={name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]
