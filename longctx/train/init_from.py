"""``model.init_from``: pretrained weights into longctx's Llama as a new stage.

Only weights are read (the optimizer, LR schedule and data position start fresh; resuming the
same stage is ``ckpt_path=``). What a source may be, and how it is checked and read, is
:mod:`longctx.hf.weight_source`; this is the training side: the model, built on the meta device
and maybe FSDP2-sharded, materialised and filled.
"""

from __future__ import annotations

import torch
from torch import nn

from longctx.hf.weight_source import check_finite_weights, resolve


def load_init_weights(model: nn.Module, device: torch.device | str) -> None:
    """Materialise a model built on the meta device (maybe FSDP2-sharded) on ``device`` and
    fill it from ``model.config.init_from``."""
    model.to_empty(device=device)
    resolve(model.config.init_from).load_into(model)
    check_finite_weights(model, f"model.init_from={model.config.init_from!r}")
