"""The plan of a layout and, when it does not fit, the smallest change of layout that does."""

from __future__ import annotations

import dataclasses

from longctx.cp_balance import rank_unit
from longctx.model.config import LlamaConfig
from longctx.planner.capacity import CapacityPlan, plan_layout
from longctx.planner.device import Device
from longctx.planner.layout import RunLayout
from longctx.planner.settings import DEFAULT_MFU


def plan(
    config: LlamaConfig, layout: RunLayout, device: Device, mfu: float = DEFAULT_MFU
) -> CapacityPlan:
    """The per-rank plan; when it does not fit, with the smallest change that does."""
    result = plan_layout(config, layout, device, mfu)
    if result.fits:
        return result
    found = suggest(config, layout, device)
    if found is None:
        return result
    change, suggested = found
    return dataclasses.replace(result, suggestion=suggested, suggestion_change=change)


def candidates(layout: RunLayout) -> list[RunLayout]:
    """Layouts within reach: checkpointing on, a smaller micro-batch, a larger CP size (with
    the nodes it needs), more nodes (for FSDP2 to shard over), and their combinations."""
    found = []
    for checkpointing in dict.fromkeys((layout.activation_checkpointing, True)):
        for mbs in range(layout.micro_batch_size, 0, -1):
            for cp in powers_of_two_from(layout.context_parallel):
                unit = rank_unit(
                    cp, layout.context_parallel_balance, layout.context_parallel_rounds
                )
                if layout.seq_len % unit:
                    continue  # the existing preflight refuses a row that does not split evenly
                for nodes in powers_of_two_from(layout.num_nodes, 4096):
                    if nodes * layout.devices % cp:
                        continue
                    found.append(dataclasses.replace(
                        layout, activation_checkpointing=checkpointing, micro_batch_size=mbs,
                        context_parallel=cp, num_nodes=nodes,
                    ))  # fmt: skip
    return found


def powers_of_two_from(start: int, stop: int = 1024) -> list[int]:
    out = [start]
    while out[-1] * 2 <= stop:
        out.append(out[-1] * 2)
    return out


def changes(old: RunLayout, new: RunLayout) -> dict[str, object]:
    keys = ("activation_checkpointing", "micro_batch_size", "context_parallel", "num_nodes")
    return {k: getattr(new, k) for k in keys if getattr(new, k) != getattr(old, k)}


def suggest(config: LlamaConfig, layout: RunLayout, device: Device) -> tuple[str, RunLayout] | None:
    """The fitting layout that needs the fewest nodes, then the fewest changed settings, then
    the smallest CP size, no recompute, the largest micro-batch. Candidates are re-planned."""

    def cost(candidate: RunLayout) -> tuple:
        n_changed = len(changes(layout, candidate))
        return (
            candidate.num_nodes, n_changed, candidate.context_parallel,
            candidate.activation_checkpointing, -candidate.micro_batch_size,
        )  # fmt: skip

    memory_only = dataclasses.replace(device, peak_flops=None)
    for candidate in sorted(candidates(layout), key=cost):
        if candidate != layout and plan_layout(config, candidate, memory_only, 1.0).fits:
            changed = changes(layout, candidate)
            return ", ".join(f"{k}={v}" for k, v in changed.items()), candidate
    return None
