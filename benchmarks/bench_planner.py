"""Is the capacity plan honest? Predicted peak memory per rank against measured peak RSS.

The tiny model (sdpa, fp32, loss_chunk_size 4096 as conf/model/tiny.yaml sets it) trains on one
row of lognormal documents (bench_step.make_batch: median 600, sigma 1.0) at L = 4k .. 128k,
with and without activation checkpointing, on 1 process (2 threads) or 2 context-parallel gloo
processes (1 thread each). Each configuration runs in fresh processes; a step is forward +
backward + gradient all-reduce (CP) + AdamW. The prediction is ``longctx.planner.plan`` for that
layout and that row's document lengths; its "runtime baseline" term is the measured peak RSS of
a fresh process that has imported torch and longctx (a constant of the CPU plan, measured here,
not fitted).

Two glibc settings (MALLOC_ENV): "live" returns every large block to the OS when it is freed,
so peak RSS is the peak of the tensors alive at once, which is what the plan counts; "retain"
is how train.py runs on CPU, where the heap keeps freed blocks and fragments on top of that.

On CUDA (``--device cuda``) the same runs compare the plan without its runtime term against
torch.cuda.max_memory_allocated (skipped on a machine without a GPU).

    nice -n 10 .venv/bin/python benchmarks/bench_planner.py       # live -> results/planner.json
    nice -n 10 .venv/bin/python benchmarks/bench_planner.py --malloc live retain --steps 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TARGET = 0.15  # |predicted / measured - 1| the issue asks for on CPU (0.10 on a GPU)
# glibc settings of a worker. "live": every block above 64 KiB is its own mmap, unmapped when
# freed, so peak RSS follows the tensors alive at once (what the plan counts). "retain": as
# train.py runs on CPU (longctx.train.cpu_memory): freed blocks stay in the heap for reuse, and the
# heap's fragmentation comes on top.
MALLOC_ENV = {"live": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "retain": {}}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- workers
def baseline_worker() -> None:
    """What every worker holds before its model exists: the interpreter and its imports."""
    import torch  # noqa: F401

    import longctx.model  # noqa: F401
    import longctx.planner  # noqa: F401

    print(json.dumps({"baseline_bytes": peak_rss_bytes()}))


def rank_worker(
    rank: int, size: int, length: int, checkpointing: bool, steps: int, device: str, malloc: str
):
    import torch
    import torch.distributed as dist

    from longctx.context_shard import context_shard
    from longctx.distributed.context_parallel import all_gather_over
    from longctx.model import Llama
    from longctx.train.cpu_memory import retain_freed_memory

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import data_parallel_step, make_batch

    if malloc == "retain":
        retain_freed_memory()
    torch.set_num_threads(max(1, 2 // size))  # the same 2 cores whatever the rank count
    if size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=size)
    group = dist.group.WORLD if size > 1 else None
    torch.manual_seed(0)
    model = Llama(tiny_config(checkpointing)).to(device)
    batch = make_batch(length, seed=0)
    shard = context_shard(batch, rank, size, all_gather_over(group)) if size > 1 else batch
    shard = shard.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        data_parallel_step(model, shard, opt, group)
    result = {
        "rank": rank,
        "step_s": (time.perf_counter() - start) / steps,
        "peak_rss_bytes": peak_rss_bytes(),
        "doc_lengths": [int(n) for n in batch.seq_lens[0] if n > 0],
    }
    if device == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if size > 1:
        dist.destroy_process_group()
    print(json.dumps(result))


def tiny_config(checkpointing: bool):
    from longctx.model import LlamaConfig

    return LlamaConfig.from_name(
        "tiny", attn_backend="sdpa", loss_chunk_size=4096, activation_checkpointing=checkpointing
    )


def run_workers(args: list[str], size: int, port: int, malloc: str = "retain") -> list[dict]:
    """``size`` fresh processes of this script; their JSON lines, by rank."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **MALLOC_ENV[malloc]}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", str(rank), str(size), *args],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(size)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


# --------------------------------------------------------------------------- compare
def predict(length: int, size: int, checkpointing: bool, doc_lengths, baseline: int) -> dict:
    from longctx import planner

    layout = planner.RunLayout(
        seq_len=length,
        devices=size,
        context_parallel=size,
        activation_checkpointing=checkpointing,
        attn_backend="sdpa",
        doc_lengths=tuple(doc_lengths),
    )
    device = planner.Device("cpu", 2**40, None, baseline, "measured")
    plan = planner.plan(tiny_config(checkpointing), layout, device)
    return {"predicted_bytes": plan.total_bytes, "terms": {t.name: t.bytes for t in plan.terms}}


def measure(
    length: int, size: int, checkpointing: bool, baseline: int, device: str, malloc: str, steps: int
) -> dict:
    port = 29500 + (os.getpid() + length + 7 * size + checkpointing) % 2000
    worker_args = [str(length), str(int(checkpointing)), str(steps), device, malloc]
    ranks = run_workers(worker_args, size, port, malloc)
    row = {
        "malloc": malloc,
        "L": length,
        "ranks": size,
        "activation_checkpointing": checkpointing,
        "steps": steps,
        "step_s": max(r["step_s"] for r in ranks),
        "measured_bytes": max(r["peak_rss_bytes"] for r in ranks),
    }
    row |= predict(length, size, checkpointing, ranks[0]["doc_lengths"], baseline)
    if device == "cuda":  # the allocator's own peak; the plan without its runtime allowance
        row["measured_bytes"] = max(r["max_memory_allocated"] for r in ranks)
        row["predicted_bytes"] -= row["terms"]["runtime baseline"]
    row["ratio"] = row["predicted_bytes"] / row["measured_bytes"]
    return row


def repredict(path: Path) -> None:
    """The current plan against stored measurements (each row's documents are make_batch's)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import make_batch

    results = json.loads(path.read_text())
    baseline = results["meta"]["baseline_bytes"]
    for row in results["rows"]:
        seq_lens = make_batch(row["L"], seed=0).seq_lens[0]
        doc_lengths = [int(n) for n in seq_lens if n > 0]
        row |= predict(
            row["L"], row["ranks"], row["activation_checkpointing"], doc_lengths, baseline
        )
        row["ratio"] = row["predicted_bytes"] / row["measured_bytes"]
    path.write_text(json.dumps(results, indent=1))
    print_table(results["rows"], baseline, "measured")
    print(f"rewrote {path}")


def print_table(rows: list[dict], baseline: int, measured_what: str) -> None:
    print(
        f"\nruntime baseline (fresh process, torch + longctx imported): {baseline / 2**30:.3f} GiB"
    )
    print(
        f"{'malloc':>6} {'L':>7} {'ranks':>5} {'ckpt':>5} {'predicted GiB':>14} {f'{measured_what} GiB':>14} "
        f"{'pred/meas':>9} {'step s':>7}"
    )
    for r in rows:
        print(
            f"{r['malloc']:>6} {r['L']:>7} {r['ranks']:>5} {str(r['activation_checkpointing']):>5} "
            f"{r['predicted_bytes'] / 2**30:>14.3f} {r['measured_bytes'] / 2**30:>14.3f} "
            f"{r['ratio']:>9.3f} {r['step_s']:>7.1f}"
        )
    for malloc in dict.fromkeys(r["malloc"] for r in rows):
        worst = max(abs(r["ratio"] - 1) for r in rows if r["malloc"] == malloc)
        print(f"{malloc}: worst |predicted/measured - 1| = {worst:.3f} (target {TARGET})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--malloc", choices=sorted(MALLOC_ENV), nargs="+", default=["live"])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--repredict", type=Path, help="recompute a results file's predictions, measure nothing"
    )
    args = parser.parse_args()
    if args.repredict:
        return repredict(args.repredict)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no GPU here; the GPU comparison is skipped")
            return
    baseline = run_workers(["baseline"], 1, 0)[0]["baseline_bytes"]
    out = args.out or RESULTS / ("planner.json" if args.device == "cpu" else "planner_cuda.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in args.lengths:
        for size in args.ranks:
            for checkpointing, malloc in itertools.product((False, True), args.malloc):
                rows.append(
                    measure(length, size, checkpointing, baseline, args.device, malloc, args.steps)
                )
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "terms"}), flush=True)
                write(out, rows, baseline, args.device)  # a long run keeps what it measured
    print_table(rows, baseline, "RSS" if args.device == "cpu" else "CUDA max alloc")
    print(f"wrote {out}")


def write(out: Path, rows: list[dict], baseline: int, device: str) -> None:
    meta = {
        "torch": __import__("torch").__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "model": "tiny, sdpa, fp32, loss_chunk_size 4096",
        "documents": "one row, lognormal median 600 sigma 1.0 (bench_step.make_batch, seed 0)",
        "measured": "peak RSS per rank (ru_maxrss), max over ranks"
        if device == "cpu"
        else "torch.cuda.max_memory_allocated, max over ranks",
        "baseline_bytes": baseline,
        "target": TARGET,
        "load_average": os.getloadavg(),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if sys.argv[4] == "baseline":
            baseline_worker()
        else:
            rank, size, length, ckpt, steps = (int(a) for a in sys.argv[2:7])
            rank_worker(rank, size, length, bool(ckpt), steps, *sys.argv[7:9])
    else:
        main()
