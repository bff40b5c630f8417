"""Run by tests/test_context_parallel.py: a Llama over N gloo ranks vs. one process.

    python context_parallel_script.py N

Every rank builds the same model and batch, takes its context shard, and computes logits, the
loss sum and every parameter gradient; gradients are summed over the ranks (what DDP/FSDP do)
and the logits gathered. Rank 0 compares them with the unsharded batch in one process, for reset
and continuous position ids, with documents straddling chunk edges, one document longer than a
chunk and a pad tail (fp32, 1e-5). Prints "compared" on success.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longctx.batch import PackedBatch
from longctx.model import Llama, LlamaConfig
from longctx.model.context_parallel import gather_row

L = 240
ROWS = [[7, 50, 1, 33, 90, 59], [240], [13] * 17 + [19]]  # one 240-token document > a chunk
CONFIG = LlamaConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    vocab_size=64,
    max_seq_len=256,
    attn_backend="sdpa",
    loss_chunk_size=50,
)


def make_batch(reset: bool) -> PackedBatch:
    tokens = torch.randint(0, 64, (len(ROWS), L), generator=torch.Generator().manual_seed(1))
    batch = PackedBatch.from_lengths(tokens, ROWS, reset_position_ids=reset)
    batch.labels[-1, -5:] = -100  # a pad tail without targets
    return batch


def results(model: Llama, batch, group=None) -> dict[str, torch.Tensor]:
    """Logits [B, L, V] (gathered), loss sum, and parameter gradients summed over the group."""
    model.zero_grad(set_to_none=True)
    logits = model(batch)
    loss_sum, _ = model.loss(batch)
    (loss_sum / 500).backward()
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    if group is not None:
        logits = gather_row(logits.detach(), group, dist.get_world_size(group))
        for grad in out.values():
            dist.all_reduce(grad, group=group)
        dist.all_reduce(loss_sum := loss_sum.detach(), group=group)
    out["logits"], out["loss"] = logits.detach(), loss_sum.detach()
    return out


def worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for reset in (True, False):
            torch.manual_seed(0)
            model = Llama(CONFIG)
            batch = make_batch(reset)
            group = dist.group.WORLD
            got = results(model, batch.context_shard(rank, world, group), group)
            if rank == 0:
                expected = results(model, batch)
                for name, value in expected.items():
                    torch.testing.assert_close(got[name], value, atol=1e-5, rtol=0, msg=name)
        if rank == 0:
            print(f"compared logits, loss and {len(expected) - 2} gradients over {world} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    port = 29000 + os.getpid() % 2000
    mp.spawn(worker, args=(world, port), nprocs=world)
