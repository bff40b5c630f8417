"""Context parallelism's process-group code: the ranks' group and the K/V all-gather.

The layout (which rank holds which tokens, and how whole rows are put back together) is
:mod:`longctx.context_shard`; a shard carries :func:`all_gather_over` its group, so the model
gathers keys and values without importing this module.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from longctx.context_shard import AllGather, check_context_parallel


def all_gather_over(group) -> AllGather:
    """The all-gather a ContextShard of ``group``'s ranks carries (context_shard's
    ``all_gather``): along dim 0, differentiable, its backward a reduce-scatter (sum)."""
    return lambda x: _AllGather.apply(x, group)


class _AllGather(torch.autograd.Function):
    """all-gather along dim 0 over ``group``; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


# torch renamed the single-tensor collectives (the old names warn from 2.13)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def context_parallel_group(context_parallel: int):
    """This rank's group of ``context_parallel`` consecutive ranks: the "cp" dimension of a
    ("dp", "cp") device mesh (row-major, so cp ranks are consecutive; see
    :func:`longctx.context_shard.data_parallel_rank_and_size`)."""
    world = dist.get_world_size()
    check_context_parallel(context_parallel, world=world)
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(
        device, (world // context_parallel, context_parallel), mesh_dim_names=("dp", "cp")
    )
    return mesh.get_group("cp")
