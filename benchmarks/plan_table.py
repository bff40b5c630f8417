"""docs/planner.md's planning table: Llama 3 8B at 8k .. 1M tokens on nodes of 8 H100/H200s.

For each row length and GPU: the smallest layout the capacity planner (longctx.planner) says
fits, searched as fewest nodes first, then smallest context-parallel size: FSDP2 in bf16 over
every rank, activation checkpointing on (conf/model/llama3_8b.yaml), one row per micro-batch,
the flash backend, loss_chunk_size 4096, one document per row (the worst case, and the full
causal attention of torchtitan's CP benchmarks). Step time is the planner's roofline at a stated
MFU; torchtitan's published CP throughputs are set beside it with the MFU they imply under the
same FLOP count. Pure arithmetic: nothing is allocated.

    .venv/bin/python benchmarks/plan_table.py        # -> results/planning_table.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from longctx import planner
from longctx.model import LlamaConfig
from longctx.model.flops import estimate_flops
from longctx.planner.settings import INTER_NODE_BYTES_PER_S, INTRA_NODE_BYTES_PER_S

RESULTS = Path(__file__).parent / "results"
LENGTHS = [8192, 32768, 65536, 131072, 262144, 524288, 1048576]
GPUS = ("H100", "H200")
MFU = planner.DEFAULT_MFU
# torchtitan's published Llama 3 8B context-parallel throughput, tokens/s per GPU
TORCHTITAN = {32768: 3890, 65536: 2540, 131072: 1071, 262144: 548}


def smallest_fit(
    config: LlamaConfig, length: int, device: planner.Device
) -> planner.CapacityPlan | None:
    for nodes in (2**i for i in range(0, 8)):
        cp = 1
        while cp <= nodes * 8 and length % (2 * cp) == 0:
            layout = planner.RunLayout(
                seq_len=length, num_nodes=nodes, devices=8, context_parallel=cp, fsdp=True,
                precision="bf16", activation_checkpointing=True, attn_backend="flash",
            )  # fmt: skip
            plan = planner.plan(config, layout, device, MFU)
            if plan.fits:
                return plan
            cp *= 2
    return None


def row(config: LlamaConfig, length: int, gpu: str) -> dict:
    plan = smallest_fit(config, length, planner.known_device(gpu))
    out = {"L": length, "gpu": gpu}
    if plan is None:
        return out | {"fits": False}
    lay, step = plan.layout, plan.step
    out |= {
        "nodes": lay.num_nodes,
        "context_parallel": lay.context_parallel,
        "memory_gib_per_gpu": plan.total_bytes / 2**30,
        "largest_term": plan.largest.name,
        "kv_gib_per_step": step.kv_bytes / 2**30,
        "fsdp_gib_per_step": step.fsdp_bytes / 2**30,
        "step_s": step.step_s,
        "tokens_per_s_per_gpu": step.tokens_per_s_per_gpu,
        "mfu": MFU,
    }
    if length in TORCHTITAN:
        flops_per_token = estimate_flops(config, torch.tensor([[length]])) / length
        out["torchtitan_tokens_per_s_per_gpu"] = TORCHTITAN[length]
        out["torchtitan_implied_mfu"] = TORCHTITAN[length] * flops_per_token / 989e12
    return out


def main() -> None:
    config = LlamaConfig.from_name("llama3_8b", attn_backend="flash", activation_checkpointing=True)
    rows = [row(config, n, gpu) for n in LENGTHS for gpu in GPUS]
    print(
        f"Llama 3 8B, FSDP2 bf16, checkpointing, 1 row/micro-batch, one document per row, "
        f"MFU {MFU}; nodes of 8 GPUs"
    )
    print(
        f"{'L':>8} {'GPU':>5} {'nodes':>5} {'CP':>3} {'GiB/GPU':>8} {'K/V GiB/step':>12} "
        f"{'tok/s/GPU':>9} {'torchtitan':>10} {'(its MFU)':>9}"
    )
    for r in rows:
        if "nodes" not in r:
            print(f"{r['L']:>8} {r['gpu']:>5}  no layout up to 128 nodes fits")
            continue
        titan = r.get("torchtitan_tokens_per_s_per_gpu")
        titan_cells = f"{titan:>10,} {r['torchtitan_implied_mfu']:>9.2f}" if titan else ""
        print(
            f"{r['L']:>8} {r['gpu']:>5} {r['nodes']:>5} {r['context_parallel']:>3} "
            f"{r['memory_gib_per_gpu']:>8.1f} {r['kv_gib_per_step']:>12.1f} "
            f"{r['tokens_per_s_per_gpu']:>9,.0f} {titan_cells}"
        )
    out = RESULTS / "planning_table.json"
    meta = {
        "model": "llama3_8b, FSDP2 bf16, activation checkpointing, loss_chunk_size 4096, flash",
        "documents": "one document per row (worst case; full causal attention)",
        "mfu": MFU,
        "peak_flops": {g: planner.KNOWN_DEVICES[g][1] for g in GPUS},
        "bandwidth_bytes_per_s": {
            "intra_node": INTRA_NODE_BYTES_PER_S,
            "inter_node": INTER_NODE_BYTES_PER_S,
        },
        "runtime_allowance_bytes": planner.CUDA_RUNTIME_BYTES,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
