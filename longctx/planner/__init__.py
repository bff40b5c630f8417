"""Capacity planner: per-rank memory and step time of a training run, before anything is allocated.

``dry_run=true`` prints a :class:`CapacityPlan` of a :class:`RunLayout` on a :class:`Device`.

    python benchmarks/plan_table.py   # docs/planner.md's Llama 3 8B table -> results/planning_table.json
"""

from longctx.planner.capacity import CapacityPlan
from longctx.planner.device import (
    CPU_HEAP_RETENTION,
    CUDA_RUNTIME_BYTES,
    KNOWN_DEVICES,
    Device,
    known_device,
    process_rss_bytes,
)
from longctx.planner.layout import RunLayout
from longctx.planner.memory import training_state_bytes
from longctx.planner.report import format_plan, plan_dict
from longctx.planner.search import plan
from longctx.planner.settings import DEFAULT_MFU, PlanError, PlannerSettings

__all__ = [
    "CPU_HEAP_RETENTION",
    "CUDA_RUNTIME_BYTES",
    "DEFAULT_MFU",
    "KNOWN_DEVICES",
    "CapacityPlan",
    "Device",
    "PlanError",
    "PlannerSettings",
    "RunLayout",
    "format_plan",
    "known_device",
    "plan",
    "plan_dict",
    "process_rss_bytes",
    "training_state_bytes",
]
