"""The capacity plan of one layout: its memory terms and peak, whether it fits, its step time."""

from __future__ import annotations

from dataclasses import dataclass

from longctx.model.config import LlamaConfig
from longctx.planner.device import Device
from longctx.planner.layout import RunLayout
from longctx.planner.memory import Term, layer_activation_bytes, memory_terms, peak_bytes
from longctx.planner.step_time import StepTime, step_time


@dataclass(frozen=True)
class CapacityPlan:
    """One layout's per-rank memory terms and step time; when it does not fit, the smallest
    change of layout that does (:func:`longctx.planner.search.plan`)."""

    layout: RunLayout
    device: Device
    terms: tuple[Term, ...]
    activations_per_layer: dict[str, int]  # saved bytes of one block, without / with checkpointing
    step: StepTime | None
    suggestion: RunLayout | None = None
    suggestion_change: str = ""
    notes: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """Held terms plus the largest phase's transient terms: the peak."""
        return peak_bytes(self.terms)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device.memory_bytes

    @property
    def largest(self) -> Term:
        return max(self.terms, key=lambda t: t.bytes)


def plan_layout(config: LlamaConfig, layout: RunLayout, device: Device, mfu: float) -> CapacityPlan:
    """The plan of exactly ``layout``, without looking for a change that fits."""
    tokens = layout.tokens_per_rank
    per_layer = {
        "without checkpointing": layer_activation_bytes(config, layout, tokens),
        "with checkpointing": tokens * config.dim * layout.residual_bytes,  # the block's input
    }
    step, notes = None, ()
    if device.peak_flops:
        step = step_time(config, layout, device, mfu)
    else:
        notes = (f"step time: unknown peak FLOP/s for {device.name}; set peak_flops_per_device",)
    terms = tuple(memory_terms(config, layout, device))
    return CapacityPlan(layout, device, terms, per_layer, step, notes=notes)
