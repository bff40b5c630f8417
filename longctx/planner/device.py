"""The accelerator a plan is for: its memory, peak FLOP/s, links and what the process holds
outside tensors (the runtime baseline)."""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

from longctx.model.validation import require_positive
from longctx.planner.settings import GIB, INTER_NODE_BYTES_PER_S, INTRA_NODE_BYTES_PER_S, PlanError

# (memory GB as sold, dense bf16 FLOP/s) of accelerators the planner knows by name
KNOWN_DEVICES = {"H100": (80, 989e12), "H200": (141, 989e12), "A100": (80, 312e12)}
# CUDA context, NCCL buffers and allocator slack per GPU: a stated allowance, not measured here
CUDA_RUNTIME_BYTES = 2 * GIB
# glibc's heap as train.py runs on CPU (longctx.train.cpu_memory.retain_freed_memory): freed
# blocks stay mapped for the next step, and their fragments leave the heap larger than the
# tensors alive at once. Measured on train.py's own path (the tiny model, micro-batch 1, peak RSS
# against this plan; benchmarks/bench_train_rss.py, results/train_rss.json) the excess is 0.22-0.30
# of the step tensors' peak after one step at 16k-64k, and grows over the first steps to 0.38
# (32k) - 0.49 (16k), where it holds (8 and 30 steps at 16k agree): an allowance, not a model of
# malloc, that keeps the plan within 12% of both
CPU_HEAP_RETENTION = 0.40


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    peak_flops: float | None  # dense FLOP/s of one device in the compute dtype; None = unknown
    baseline_bytes: int  # what the process holds outside tensors (see module docstring)
    baseline_note: str
    intra_node_bytes_per_s: float = INTRA_NODE_BYTES_PER_S
    inter_node_bytes_per_s: float = INTER_NODE_BYTES_PER_S
    # the allocator's excess over the tensors alive at once, as a fraction of their peak
    # (CPU_HEAP_RETENTION for train.py on CPU; 0 where a caching allocator reuses exactly)
    heap_retention: float = 0.0

    def __post_init__(self) -> None:
        require_positive(
            "planner.device_memory_gb", self.memory_bytes, PlanError, "the device memory"
        )
        if not (math.isfinite(self.heap_retention) and self.heap_retention >= 0):
            raise PlanError(f"heap_retention={self.heap_retention!r}; expected a fraction >= 0")
        if self.peak_flops is not None:
            require_positive("peak_flops_per_device", self.peak_flops, PlanError, "the peak FLOP/s")
        for name, key in (
            ("intra_node_bytes_per_s", "intra_node_gb_per_s"),
            ("inter_node_bytes_per_s", "inter_node_gb_per_s"),
        ):
            setting = f"{name} (planner.{key} x 1e9)"
            bandwidth = "the collective bandwidth per GPU"
            require_positive(setting, getattr(self, name), PlanError, bandwidth)


def known_device(name: str, baseline_bytes: int = CUDA_RUNTIME_BYTES) -> Device:
    key = next((k for k in KNOWN_DEVICES if k.lower() in name.lower()), None)
    if key is None:
        raise PlanError(
            f"device {name!r} is not one the planner knows ({sorted(KNOWN_DEVICES)}): set "
            "planner.device_memory_gb and peak_flops_per_device"
        )
    memory_gb, peak = KNOWN_DEVICES[key]
    return Device(key, int(memory_gb * 1e9), peak, baseline_bytes, "CUDA context + NCCL (stated)")


def process_rss_bytes() -> int:
    """Peak RSS of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
