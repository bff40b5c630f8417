"""Run by tests/e2e/test_context_parallel.py: a Llama over W gloo ranks vs. one process.

    python context_parallel_script.py W N BALANCE [K]

W ranks form W/N data-parallel replicas of N context-parallel ranks, sharded by the balancer
BALANCE (head_tail, rounds with K rounds, documents). Every replica gets its own batch and every
rank of a replica takes its context shard of it, computing logits, the loss sum and every
parameter gradient; gradients and losses are summed over all ranks (what DDP/FSDP do) and the
logits gathered within each replica. Rank 0 compares them with one process running all the
replicas' batches, for reset and continuous position ids, with B = 3 rows: documents straddling
chunk edges and longer than L/N, one document filling its row, and documents all shorter than a
chunk followed by a pad tail; and a row where some ranks need no other rank's keys (yet every
rank must join the gather's reduce-scatter) (fp32, 1e-5). Prints "compared".
"""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_close_scaled

from longctx.batch import PackedBatch
from longctx.context_shard import context_shard, data_parallel_rank_and_size, gather_row
from longctx.distributed.context_parallel import all_gather_over, context_parallel_group
from longctx.model import Llama, LlamaConfig

L = 240
ROWS = [[7, 50, 1, 33, 90, 59], [240], [13] * 17]  # the last row: a 19-token pad tail
# a row where some ranks need other ranks' keys and others need none (head_tail and documents
# over 2 ranks: rank 1 needs none; documents over 4: ranks 2 and 3): every rank's backward must
# still join the gather's reduce-scatter
UNEVEN_ROWS = [[55, 5, 50, 69, 58, 3]]
CASES = [(ROWS, True), (ROWS, False), (UNEVEN_ROWS, True)]  # (rows, reset position ids)
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


def make_batch(rows, reset: bool, replica: int) -> PackedBatch:
    gen = torch.Generator().manual_seed(1 + replica)
    tokens = torch.randint(0, 64, (len(rows), L), generator=gen)
    batch = PackedBatch.from_lengths(tokens, rows, reset_position_ids=reset)
    batch.labels[-1, sum(rows[-1]) :] = -100  # a pad tail has no targets
    return batch


def results(model: Llama, batch) -> dict[str, torch.Tensor]:
    """Logits [B, 2c or L, V], loss sum and parameter gradients of one batch or shard."""
    model.zero_grad(set_to_none=True)
    logits = model(batch)
    loss_sum, _ = model.loss(batch)
    (loss_sum / 500).backward()
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    out["logits"], out["loss"] = logits.detach(), loss_sum.detach()
    return out


def reference(model: Llama, batches: list[PackedBatch]) -> dict[str, torch.Tensor]:
    """One process, every replica's batch: logits stacked by replica, the rest summed."""
    each = [results(model, b) for b in batches]
    out = {k: sum(r[k] for r in each) for k in each[0] if k != "logits"}
    out["logits"] = torch.stack([r["logits"] for r in each])
    return out


def distributed(model, batches, context_parallel: int, balance: str, rounds: int) -> dict:
    """This rank's share; on return, sums over all ranks and logits of every replica."""
    group = context_parallel_group(context_parallel)
    replica, replicas = data_parallel_rank_and_size(
        dist.get_rank(), dist.get_world_size(), context_parallel
    )
    rank = dist.get_rank(group)
    shard = context_shard(
        batches[replica],
        rank,
        context_parallel,
        all_gather_over(group),
        balance=balance,
        rounds=rounds,
    )
    out = results(model, shard)
    for key, value in out.items():
        if key != "logits":
            dist.all_reduce(value)
    row_logits = gather_row(out["logits"], shard)
    every = [torch.empty_like(row_logits) for _ in range(dist.get_world_size())]
    dist.all_gather(every, row_logits)
    out["logits"] = torch.stack(every[::context_parallel])  # one copy per replica
    return out


def worker(rank: int, world: int, context_parallel: int, balance: str, rounds: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a rank left waiting in a collective fails the run in a minute, not at the test's timeout
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        for rows, reset in CASES:
            torch.manual_seed(0)
            # with activation checkpointing, backward re-gathers K/V on every rank in step
            model = Llama(dataclasses.replace(CONFIG, activation_checkpointing=not reset))
            batches = [make_batch(rows, reset, r) for r in range(world // context_parallel)]
            got = distributed(model, batches, context_parallel, balance, rounds)
            if rank == 0:
                expected = reference(model, batches)
                for name, value in expected.items():
                    assert_close_scaled(got[name], value, msg=name)
        if rank == 0:
            print(f"compared logits, loss and {len(expected) - 2} gradients over {world} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, context_parallel = map(int, sys.argv[1:3])
    balance, rounds = sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 1
    port = 29000 + os.getpid() % 2000
    args = (world, context_parallel, balance, rounds, port)
    mp.spawn(worker, args=args, nprocs=world)
