"""The training process itself: which rank writes the run folder, and a clean exit."""

from __future__ import annotations

import sys

import torch


def writes_run_folder() -> bool:
    """Global rank 0 (from the launcher's environment; 0 when not launched as a rank)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def teardown() -> None:
    """Stop data-loader workers, finish the W&B run and destroy the process group (without it
    rank 1 aborts at exit)."""
    import multiprocessing

    # workers still alive (a run stopped mid-epoch leaves its iterator's) ignore SIGTERM
    # (longctx.data.datamodule._worker_init), and multiprocessing's exit handler would SIGTERM
    # them and then wait for them forever
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=30)
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
