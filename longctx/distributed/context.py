"""Process groups for context parallelism: ranks form a (data parallel x context parallel) mesh.

Global rank ``r`` is context-parallel rank ``r % N`` of data-parallel replica ``r // N``: the N
ranks sharing a row are consecutive, so on a multi-GPU node they sit on one node, where the
per-layer K/V all-gather is fastest. Gradients are still reduced over the whole world by DDP or
FSDP2 (every rank holds different tokens), so those strategies need no change.
"""

from __future__ import annotations

import torch.distributed as dist


def data_parallel_rank_and_size(rank: int, world: int, context_parallel: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` in a world of ``world``."""
    check_context_parallel(context_parallel, world)
    return rank // context_parallel, world // context_parallel


def check_context_parallel(context_parallel: int, world: int) -> None:
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int):
        raise ValueError(f"context_parallel={context_parallel!r}; expected an int >= 1")
    if context_parallel < 1 or context_parallel > world or world % context_parallel:
        raise ValueError(
            f"context_parallel={context_parallel} must be >= 1 and divide the world size "
            f"{world} (processes x nodes): each row is split over that many ranks"
        )


def context_parallel_group(context_parallel: int):
    """This rank's group of ``context_parallel`` consecutive ranks (every rank creates all)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_context_parallel(context_parallel, world)
    mine = None
    for start in range(0, world, context_parallel):
        ranks = list(range(start, start + context_parallel))
        group = dist.new_group(ranks)  # collective: every rank creates every group, in order
        if rank in ranks:
            mine = group
    return mine
