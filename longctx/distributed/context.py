"""Process groups for context parallelism: ranks form a (data parallel x context parallel) mesh.

Global rank ``r`` is context-parallel rank ``r % N`` of data-parallel replica ``r // N``: the N
ranks sharing a row are consecutive, so on a multi-GPU node they sit on one node, where the
per-layer K/V all-gather is fastest. Gradients are still reduced over the whole world by DDP or
FSDP2 (every rank holds different tokens), so those strategies need no change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from longctx.model.context_parallel import check_context_parallel


def data_parallel_rank_and_size(rank: int, world: int, context_parallel: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of global ``rank`` in a world of ``world``."""
    check_context_parallel(context_parallel, world=world)
    return rank // context_parallel, world // context_parallel


def context_parallel_group(context_parallel: int):
    """This rank's group of ``context_parallel`` consecutive ranks: the "cp" dimension of a
    ("dp", "cp") device mesh (row-major, so cp ranks are consecutive)."""
    world = dist.get_world_size()
    check_context_parallel(context_parallel, world=world)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device, (world // context_parallel, context_parallel), mesh_dim_names=("dp", "cp")
    )
    return mesh.get_group("cp")
