"""The capacity plan as the dry run prints it, and as the run record keeps it."""

from __future__ import annotations

import dataclasses

from longctx.planner.capacity import CapacityPlan
from longctx.planner.memory import Term
from longctx.planner.settings import GIB


def format_plan(plan: CapacityPlan) -> str:
    lay, dev = plan.layout, plan.device
    strategy = "FSDP2" if lay.fsdp else "replicated"
    lines = [
        f"capacity plan, per rank: {dev.name}, {lay.num_nodes} node(s) x {lay.devices} device(s), "
        f"{strategy}, context_parallel={lay.context_parallel}, {lay.precision}, "
        f"attn_backend={lay.attn_backend}, activation checkpointing "
        f"{'on' if lay.activation_checkpointing else 'off'}",
        f"  row {lay.seq_len:,} tokens x micro_batch_size {lay.micro_batch_size}: "
        f"{lay.tokens_per_rank:,} tokens per rank",
    ]
    lines += [
        f"  {t.name:<52} {t.bytes / GIB:>10.3f} GiB  {' '.join(filter(None, (t.note, phases_note(t))))}"
        for t in plan.terms
    ]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(
        f"  {'peak: held + the largest backward phase':<52} {plan.total_bytes / GIB:>10.3f} GiB  of {dev.memory_bytes / GIB:,.1f} "
        f"GiB: {verdict}; largest term: {plan.largest.name}"
    )
    per_layer = ", ".join(f"{k} {v / GIB:.3f} GiB" for k, v in plan.activations_per_layer.items())
    lines.append(f"  activations per block: {per_layer}")
    if not plan.fits:
        lines.append(
            f"  smallest change that fits: {plan.suggestion_change}"
            if plan.suggestion
            else "  no single change of checkpointing / micro_batch_size / CP / nodes fits"
        )
    if plan.step:
        s = plan.step
        lines += [
            f"  step time (roofline, {s.documents}): {s.flops_per_rank / 1e12:,.1f} TFLOP per rank"
            f" at {s.peak_flops / 1e12:,.0f} TFLOP/s x MFU {s.mfu:.2f} = {s.compute_s:.3f} s; "
            f"FSDP2 {s.fsdp_bytes / GIB:,.2f} GiB {s.fsdp_s:.3f} s (overlapped); "
            f"K/V {s.kv_bytes / GIB:,.2f} GiB {s.kv_s:.3f} s",
            f"  step {s.step_s:.3f} s, {s.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
            f"{lay.max_steps} steps in {s.wall_s / 3600:,.2f} h",
        ]
        if lay.context_parallel > 1:
            lines.append(
                f"  context parallel balance={lay.context_parallel_balance}: expected attention "
                f"work imbalance {s.cp_work_imbalance:.3f} (max / mean over ranks; counted in "
                "the step time: the ranks wait for the slowest at every layer)"
            )
    lines += [f"  {n}" for n in plan.notes]
    return "\n".join(lines)


def phases_note(term: Term) -> str:
    return f"[{' / '.join(term.phases)} backward only]" if term.phases else ""


def plan_dict(plan: CapacityPlan) -> dict:
    return {
        "layout": dataclasses.asdict(plan.layout),
        "device": dataclasses.asdict(plan.device),
        "terms_bytes": {t.name: t.bytes for t in plan.terms},
        "total_bytes": plan.total_bytes,
        "fits": plan.fits,
        "largest_term": plan.largest.name,
        "activations_per_layer_bytes": plan.activations_per_layer,
        "suggestion": plan.suggestion_change or None,
        "step": None if plan.step is None else dataclasses.asdict(plan.step),
    }
