"""Run by tests/e2e/test_dp_balance_gloo.py: one optimizer step with data.dp_balance equals the
step without it, over gloo ranks.

    python dp_balance_script.py FOLDER WORLD CONTEXT_PARALLEL ACCUMULATION

WORLD ranks form WORLD / CONTEXT_PARALLEL data-parallel ranks, each of CONTEXT_PARALLEL ranks
that split every row (the "documents" context-parallel balancer). Every data-parallel rank
reads its ACCUMULATION micro-batches of the step from the train stream of the prepared FOLDER
(LongCtxDataModule), balanced and not; each rank backpropagates the loss sum of its (shard of
its) micro-batches, and the loss sums, target counts and gradients are summed over all ranks
and divided by the step's targets: what LongCtxModule's step does (DDP/FSDP average, times the
world, over the targets). Rank 0 checks that the balanced step moved rows between ranks and
that its loss and every gradient equal the unbalanced step's (fp32, 1e-5 of the largest value),
for two steps; prints "equal".
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_close_scaled

from longctx.context_shard import context_shard, data_parallel_rank_and_size
from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.dp_balance import RowCost
from longctx.distributed.context_parallel import all_gather_over, context_parallel_group
from longctx.model import Llama, LlamaConfig

STEPS = 2
COST = RowCost(1.0, 0.05)
DATA = dict(seq_len=64, micro_batch_size=2, buffer_size=8, chunk_documents=24, num_streams=2)
CONFIG = LlamaConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=260, max_seq_len=64,
    attn_backend="sdpa",
)  # fmt: skip


def batches(folder: str, balance: bool, rank: int, ranks: int, accumulation: int) -> list:
    """This data-parallel rank's micro-batches of the first STEPS steps."""
    config = DataConfig(shards=[folder], dp_balance=balance, **DATA)
    dm = LongCtxDataModule(
        config, rank=rank, world_size=ranks, accumulate_grad_batches=accumulation,
        row_cost=COST if balance else None,
    )  # fmt: skip
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    return [next(loader) for _ in range(STEPS * accumulation)]


def step(model: Llama, micro_batches: list, context_parallel: int, group) -> dict:
    """One step's loss and gradients summed over every rank, over the step's targets."""
    model.zero_grad(set_to_none=True)
    loss, targets = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for batch in micro_batches:
        if context_parallel > 1:
            rank = dist.get_rank(group)
            batch = context_shard(
                batch, rank, context_parallel, all_gather_over(group), balance="documents"
            )
        loss_sum, num_targets = model.loss(batch)
        loss_sum.backward()
        loss, targets = loss + loss_sum.detach().double(), targets + num_targets
    out = {name: p.grad.clone() for name, p in model.named_parameters()}
    out["loss"] = loss
    for value in [*out.values(), targets]:
        dist.all_reduce(value)
    return {name: value / targets for name, value in out.items()}


def worker(rank: int, folder: str, world: int, context_parallel: int, accumulation: int, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        group = context_parallel_group(context_parallel) if context_parallel > 1 else None
        dp_rank, dp_size = data_parallel_rank_and_size(rank, world, context_parallel)
        plain = batches(folder, False, dp_rank, dp_size, accumulation)
        balanced = batches(folder, True, dp_rank, dp_size, accumulation)
        moved = torch.tensor(
            [sum(not torch.equal(a.tokens, b.tokens) for a, b in zip(plain, balanced, strict=True))]
        )
        dist.all_reduce(moved)
        torch.manual_seed(0)
        model = Llama(CONFIG)
        for s in range(STEPS):
            each = slice(s * accumulation, (s + 1) * accumulation)
            expected = step(model, plain[each], context_parallel, group)
            got = step(model, balanced[each], context_parallel, group)
            if rank == 0:
                for name, value in expected.items():
                    assert_close_scaled(got[name], value, msg=f"step {s}: {name}")
        if rank == 0:
            assert int(moved) > 0, "balancing moved no micro-batch: nothing was compared"
            print(f"equal: loss and {len(expected) - 1} gradients, {int(moved)} batches moved")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    folder, (world, context_parallel, accumulation) = sys.argv[1], map(int, sys.argv[2:5])
    port = 29000 + os.getpid() % 2000
    args = (folder, world, context_parallel, accumulation, port)
    # fork: the ranks share the imports already made (spawn would import torch and Lightning again)
    mp.start_processes(worker, args=args, nprocs=world, start_method="fork")
