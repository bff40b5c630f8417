"""Run by tests/test_probe_cp.py: the leak probe through context-parallel shards over W gloo ranks.

    python probe_cp_script.py W [K]

W ranks share every row (context_parallel = W, K head-tail rounds). For sdpa and eager, reset
and continuous positions, the probe must pass; with each model-side bug injected
(longctx.probe.inject) it must fail. Rank 0 prints one line per case:
``<backend> <arm> <bug or ->: PASS`` or ``...: FAIL <check> <where>``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from probe_fixtures import VOCAB, make_rows

from longctx.context_shard import context_shard
from longctx.distributed.context_parallel import all_gather_over, context_parallel_group
from longctx.model import Llama, LlamaConfig
from longctx.probe import inject
from longctx.probe.checks import Target, packed_lm_forward, probe

# probe_fixtures' rows: documents straddling chunk edges (chunks of 24 at W=2), one longer than
# a chunk, pad tails
BUGS = [None, "drop_cp_boundaries", "reset_at_chunk_edges", "causal_row"]


def worker(rank: int, world: int, rounds: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        group = context_parallel_group(world)
        cp_rank = dist.get_rank(group)
        balance = "rounds" if rounds > 1 else "head_tail"  # the layouts the messages name
        shard = lambda batch: context_shard(  # noqa: E731
            batch, cp_rank, world, all_gather_over(group), balance=balance, rounds=rounds
        )
        for backend in ("sdpa", "eager"):
            torch.manual_seed(0)
            config = LlamaConfig(
                dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=VOCAB,
                max_seq_len=256, attn_backend=backend, loss_chunk_size=50,
            )  # fmt: skip
            model = Llama(config).eval()
            for reset in (True, False):
                for bug in BUGS:
                    target = Target(
                        packed_lm_forward(model),
                        VOCAB,
                        reset,
                        shard=inject.shard_with_bug(shard, bug),
                    )
                    report = probe(target, [make_rows(reset)])
                    if rank == 0:
                        f = report.first_failure
                        verdict = "PASS" if f is None else f"FAIL {f.check} {f.where}"
                        arm = "reset" if reset else "continuous"
                        print(f"{backend} {arm} {bug or '-'}: {verdict}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, *rounds = map(int, sys.argv[1:])
    port = 29000 + os.getpid() % 2000
    mp.spawn(worker, args=(world, *(rounds or [1]), port), nprocs=world)
