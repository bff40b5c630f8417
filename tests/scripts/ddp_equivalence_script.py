"""Run by tests/test_module.py: k SGD steps with DDP on 2 CPU processes (gloo).

Rank r trains on micro-batch 2*step + r; the single-process reference trains on both stacked.
Rank 0 writes the final parameters to the path given as argv[1].
"""

import os
import sys

import torch
from module_fixtures import fit, random_batch, small_module

STEPS = 3
# unequal target counts per rank (every segment loses one target): 124 vs 120
ROWS = [[[5, 20, 39], [64]], [[2, 2, 2, 2, 56], [3, 3, 58]]]


def rank_batches() -> list:
    return [random_batch(100 + i, ROWS[i % 2], 64) for i in range(2 * STEPS)]


if __name__ == "__main__":
    # Lightning's launcher re-runs this script for rank 1 with LOCAL_RANK set; rank 0 has none
    rank = int(os.environ.get("LOCAL_RANK", 0))
    mine = rank_batches()[rank::2]  # explicit rank split: no sampler shuffling in the way
    module = small_module()
    trainer = fit(module, mine, STEPS, devices=2, strategy="ddp", use_distributed_sampler=False)
    if trainer.global_rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in module.model.state_dict().items()}, sys.argv[1]
        )
    torch.distributed.destroy_process_group()
