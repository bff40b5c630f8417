"""Step time as a roofline: model FLOPs (``longctx.model.estimate_flops``, attention inside
documents only) over peak x MFU, plus FSDP2's parameter traffic where it outlasts compute
(prefetched, so it overlaps) and the K/V all-gather, which sits on the critical path."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from longctx.model.config import LlamaConfig
from longctx.model.flops import estimate_flops, training_flops
from longctx.planner.cp_simulation import expected_cp_work_imbalance
from longctx.planner.device import Device
from longctx.planner.layout import RunLayout, documents_note, layout_rows
from longctx.planner.settings import PlanError


@dataclass(frozen=True)
class StepTime:
    flops_per_rank: float  # model FLOPs of one optimizer step on one rank
    peak_flops: float
    mfu: float
    compute_s: float
    fsdp_bytes: float  # parameter all-gathers + gradient reduce-scatter received per rank
    fsdp_s: float
    kv_bytes: float  # context-parallel K/V all-gather + reduce-scatter received per rank
    kv_s: float
    step_s: float
    tokens_per_s_per_gpu: float
    wall_s: float  # max_steps steps
    documents: str
    cp_work_imbalance: float = 1.0  # expected max / mean attention work over the CP ranks


def step_time(config: LlamaConfig, layout: RunLayout, device: Device, mfu: float) -> StepTime:
    if device.peak_flops is None:
        raise PlanError(
            f"peak FLOP/s of a {device.name} device is unknown: set peak_flops_per_device "
            "(dense FLOP/s of one device in the compute dtype, e.g. 989e12 for an H100 in bf16)"
        )
    if not 0 < mfu <= 1:
        raise PlanError(f"planner.mfu={mfu}; expected a fraction in (0, 1]")
    rows = layout_rows(layout)
    lens = pad_sequence([torch.from_numpy(r) for r in rows], batch_first=True)
    row_flops = estimate_flops(config, lens) / len(rows)
    # every layer's all-gather waits for the rank with the most attention work
    imbalance = expected_cp_work_imbalance(layout).mean if layout.context_parallel > 1 else 1.0
    c = config
    attention = training_flops(0, c.head_dim, c.n_heads, c.n_layers, lens) / len(rows)
    row_flops += (imbalance - 1) * attention
    micro = layout.micro_batch_size * row_flops / layout.context_parallel
    flops = micro * layout.accumulate_grad_batches
    compute_s = flops / (device.peak_flops * mfu)
    fsdp_bytes, kv_bytes = fsdp_traffic(config, layout), kv_traffic(config, layout)
    fsdp_s = fsdp_bytes / bandwidth(layout, layout.world, device)
    kv_s = kv_bytes / bandwidth(layout, layout.context_parallel, device)
    step_s = max(compute_s, fsdp_s) + kv_s  # FSDP2 prefetches (overlaps); the K/V gather blocks
    tokens = layout.micro_batch_size * layout.seq_len * layout.accumulate_grad_batches
    tokens_per_gpu = tokens / layout.context_parallel / step_s
    return StepTime(
        flops, device.peak_flops, mfu, compute_s, fsdp_bytes, fsdp_s, kv_bytes, kv_s, step_s,
        tokens_per_gpu, step_s * layout.max_steps, documents_note(layout), imbalance,
    )  # fmt: skip


def fsdp_traffic(config: LlamaConfig, layout: RunLayout) -> float:
    """Bytes one rank receives per optimizer step: parameters all-gathered in forward and again
    in backward (resharded after forward) per micro-batch, and again in the recompute with
    checkpointing; fp32 gradients reduce-scattered once per step."""
    if not layout.fsdp or layout.world == 1:
        return 0.0
    others = (layout.world - 1) / layout.world
    gathers = 3 if layout.activation_checkpointing else 2
    params = config.num_params()
    per_micro = gathers * params * layout.compute_bytes * others
    return per_micro * layout.accumulate_grad_batches + params * 4 * others


def kv_traffic(config: LlamaConfig, layout: RunLayout) -> float:
    """Bytes one rank receives per optimizer step for K and V: per block, the forward
    all-gather (again in the recompute with checkpointing) and the backward reduce-scatter."""
    cp = layout.context_parallel
    if cp == 1:
        return 0.0
    c = config
    per_block = 2 * layout.micro_batch_size * layout.seq_len * (cp - 1) / cp
    per_block *= c.n_kv_heads * c.head_dim * layout.compute_bytes
    passes = 3 if layout.activation_checkpointing else 2
    return per_block * passes * c.n_layers * layout.accumulate_grad_batches


def bandwidth(layout: RunLayout, group: int, device: Device) -> float:
    """A group of consecutive ranks larger than a node crosses the network."""
    return (
        device.intra_node_bytes_per_s if group <= layout.devices else device.inter_node_bytes_per_s
    )
