"""An FSDP2 (DTensor) save of the small Llama and its AdamW state after one step, as Lightning's
ModelParallelStrategy writes it, in one gloo process: python dcp_save_script.py OUT."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from longctx.batch import PackedBatch
from longctx.distributed.fsdp import apply_fsdp
from longctx.model import Llama, LlamaConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_dim=128, vocab_size=300, attn_backend="sdpa")  # fmt: skip
    model = apply_fsdp(Llama(config), init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = PackedBatch.from_lengths(torch.randint(0, 300, (1, 16)), [[16]], True)
    loss_sum, count = model.loss(batch)
    (loss_sum / count).backward()
    optimizer.step()
    state = {
        "state_dict": {f"model.{k}": v for k, v in get_model_state_dict(model).items()},
        "optimizer_0": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
