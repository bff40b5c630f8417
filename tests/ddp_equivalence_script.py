"""Run by tests/test_module.py: k SGD steps with DDP on 2 CPU processes (gloo).

Rank r trains on micro-batch 2*step + r; the single-process reference trains on both stacked.
Rank 0 writes the final parameters to the path given as argv[1].
"""

import sys

import lightning as L
import torch
from module_fixtures import random_batch, small_module

STEPS = 3


def rank_batches() -> list:
    return [random_batch(100 + i, ROWS[i % 2], 64) for i in range(2 * STEPS)]


# unequal target counts per rank (every segment loses one target): 124 vs 120
ROWS = [[[5, 20, 39], [64]], [[2, 2, 2, 2, 56], [3, 3, 58]]]

if __name__ == "__main__":
    out = sys.argv[1]
    module = small_module()
    batches = rank_batches()

    class PerRank(torch.utils.data.Dataset):
        def __len__(self):
            return STEPS

        def __getitem__(self, step):  # explicit rank split: no sampler shuffling in the way
            return batches[2 * step + trainer.global_rank]

    loader = torch.utils.data.DataLoader(PerRank(), batch_size=None, collate_fn=lambda b: b)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, train_dataloaders=loader)
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.model.state_dict().items()}, out)
    torch.distributed.destroy_process_group()
