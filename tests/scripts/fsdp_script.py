"""Run by tests/test_fsdp.py: FSDP2 (longctx.distributed.fsdp.FSDP2Strategy) on CPU with gloo.

python fsdp_script.py --devices N --steps S --out params.pt [--start K --resume CKPT]
    [--save CKPT] [--momentum] [--init-from DIR --read-report FILE]

Global step s trains on the micro-batches 2s and 2s+1 of rank_batches(): with 2 processes
rank r takes 2s+r, with 1 process both stacked, so every world size sees the same data.
--start K --resume CKPT continues from a checkpoint written after K steps. The full
(unsharded) parameters go to --out from rank 0; --save writes a sharded checkpoint at the end.
--init-from starts from a transformers folder (model.init_from); each rank writes how many
elements it read from the safetensors files to FILE.<rank>.
"""

import argparse
import json
import math
from dataclasses import replace
from functools import partial
from pathlib import Path

import lightning as L
import torch
from module_fixtures import cat_batches, random_batch, small_module
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from longctx.distributed.fsdp import FSDP2Strategy

ROWS = [[[5, 20, 39], [64]], [[2, 2, 2, 2, 56], [3, 3, 58]]]  # unequal targets per rank


def rank_batches(steps: int) -> list:
    return [random_batch(100 + i, ROWS[i % 2], 64) for i in range(2 * steps)]


class Steps(torch.utils.data.IterableDataset):
    def __init__(self, batches: list, start: int, steps: int, world: int, rank_of):
        self.batches, self.start, self.steps, self.world, self.rank_of = (
            batches,
            start,
            steps,
            world,
            rank_of,
        )

    def __iter__(self):
        for s in range(self.start, self.steps):
            pair = self.batches[2 * s : 2 * s + 2]
            yield cat_batches(pair) if self.world == 1 else pair[self.rank_of()]


def count_reads() -> dict:
    """Count the elements init_from reads from safetensors (by wrapping its reader)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import longctx.hf.weight_source as weight_source

    read = {"elements": 0}

    class Counting(HuggingFaceStorageReader):
        def _process_read_request(self, f, req, planner):
            read["elements"] += math.prod(req.lengths)
            super()._process_read_request(f, req, planner)

    weight_source._hf_reader = lambda path: Counting(str(path))
    return read


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--resume")
    ap.add_argument("--save")
    ap.add_argument("--momentum", action="store_true")
    ap.add_argument("--init-from")
    ap.add_argument("--read-report")
    args = ap.parse_args()

    read = count_reads() if args.init_from else None
    module = small_module(init_from=args.init_from)
    if args.momentum:
        module.optim = replace(
            module.optim, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        )
    data = Steps(rank_batches(args.steps), args.start, args.steps, args.devices, lambda: rank)
    loader = torch.utils.data.DataLoader(data, batch_size=None, collate_fn=lambda b: b)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=FSDP2Strategy(),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    rank = trainer.global_rank
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)
    assert trainer.global_step == args.steps, trainer.global_step
    if args.save:
        trainer.save_checkpoint(args.save)
    full = get_model_state_dict(
        module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, args.out)
    if args.read_report:
        Path(f"{args.read_report}.{rank}").write_text(json.dumps(read))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
