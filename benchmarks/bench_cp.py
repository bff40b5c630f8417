"""Context parallelism on CPU: the balancers side by side (work, pieces, attention time, step).

Rows of lognormal documents (median 600, sigma 1.0; bench_step.make_batch), every balancer of
longctx.cp_balance on the same rows in one run:

1. Balance (pure arithmetic on the plans, 16 rows): work imbalance, max / mean over the ranks of
   in-document causal pairs (what training logs as train/cp_work_imbalance; max / min too),
   mean and worst row; pieces of split documents per rank; and the planner's expectation
   (longctx.planner.cp_simulation.expected_cp_work_imbalance) for the same distribution, from its own rows,
   with the mean over 128 rows of this generator beside it (16 rows are a noisy sample).
2. Attention time per rank (forward + backward of one layer's attention, tiny shape, sdpa):
   2 ranks measured for real on 2 gloo processes (1 thread each: K/V all-gather, attention,
   reduce-scatter in backward); for 2, 4 and 8 ranks each rank's attention computed alone in
   this process (1 thread, its shard's pieces against the whole row's K/V): what that rank
   computes, without the collectives. A layer waits for its slowest rank.
3. Training step: forward + backward + gradient all-reduce + AdamW of the tiny model on one
   row, 1 process with 2 threads vs. 2 gloo processes with 1 thread each (the same 2 cores),
   per balancer; each configuration in fresh processes, so peak RSS is per rank.
4. Communication: bytes each rank receives per layer in the forward K/V all-gather (the same
   for every balancer: each rank holds L/N tokens).

    .venv/bin/python benchmarks/bench_cp.py           # 32k and 128k -> results/cp.json
    .venv/bin/python benchmarks/bench_cp.py --quick   # 2k, smoke test -> results/cp_quick.json
    .venv/bin/python benchmarks/bench_cp.py --step-lengths 32768 131072   # 128k steps too

Steps run at 32k by default: a 2-rank step of the tiny model at 128k takes minutes on a shared
2-core machine (results/cp.json holds one 128k run, made with the line above).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longctx import planner
from longctx.context_shard import context_shard
from longctx.cp_balance import DEFAULT_BALANCE, plan_stats, row_owner
from longctx.distributed.context_parallel import all_gather_over
from longctx.model import Llama, LlamaConfig
from longctx.model.attention import (
    attention_over_row,
    build_attention_metadata,
    context_attention,
)
from longctx.planner.cp_simulation import expected_cp_work_imbalance

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import data_parallel_step, make_batch  # noqa: E402  (lognormal documents)

RESULTS = Path(__file__).parent / "results"
# (name, balance, rounds) side by side
BALANCERS = [
    ("head_tail", "head_tail", 1),
    ("rounds16", "rounds", 16),
    ("rounds64", "rounds", 64),
    ("documents", "documents", 1),
]
SIZES = (2, 4, 8)
TINY = LlamaConfig.from_name("tiny", attn_backend="sdpa")
HEADS, KV_HEADS, HEAD_DIM = TINY.n_heads, TINY.n_kv_heads, TINY.head_dim
SHAPES = {  # (KV heads, head dim, bytes per element, layers)
    "tiny fp32": (KV_HEADS, HEAD_DIM, 4, TINY.n_layers),
    "llama3_8b bf16": (8, 128, 2, 32),
}
DOCUMENTS = "lognormal median 600 sigma 1.0, one row per batch (bench_step.make_batch)"


def row_lengths(length: int, seed: int) -> np.ndarray:
    lens = make_batch(length, seed=seed).seq_lens[0]
    return lens[lens > 0].numpy().astype(np.int64)


# --------------------------------------------------------------------------- 1. balance
# rows of the same generator over which the planner's expectation is also compared: 16 rows
# of head_tail have a standard error of 5-8% of its mean imbalance (per-row spread 0.3-0.6)
DISTRIBUTION_ROWS = 128


def balance(length: int, size: int, rows: int) -> dict:
    """Per balancer: work imbalance (max/mean, max/min) mean and worst over rows, pieces; and
    the max/mean mean over DISTRIBUTION_ROWS rows (the first ``rows`` of them included)."""
    out = {"L": length, "ranks": size, "rows": rows}
    lens_rows = [row_lengths(length, seed) for seed in range(max(rows, DISTRIBUTION_ROWS))]
    for name, how, rounds in BALANCERS:
        every = [plan_stats([r], [row_owner(r, size, how, rounds)], size) for r in lens_rows]
        stats = every[:rows]
        max_mean = [s.work_imbalance for s in stats]
        max_min = [max(s.work) / min(s.work) for s in stats]
        layout = planner.RunLayout(
            seq_len=length,
            devices=size,
            context_parallel=size,
            context_parallel_balance=how,
            context_parallel_rounds=rounds,
            doc_length_lognormal=(600.0, 1.0),
        )
        expected = expected_cp_work_imbalance(layout)
        out[name] = {
            "max_mean": {"mean": statistics.fmean(max_mean), "worst": max(max_mean)},
            "max_min": {"mean": statistics.fmean(max_min), "worst": max(max_min)},
            "pieces_per_rank": statistics.fmean(s.pieces_per_rank for s in stats),
            "planner_expected_max_mean": expected.mean,
            "distribution": {
                "rows": len(every),
                "max_mean": statistics.fmean(s.work_imbalance for s in every),
            },
        }
    return out


# --------------------------------------------------------------------------- 2. attention
def attention_seconds(shard, q, k_local, v_local, k_row, v_row) -> float:
    """Forward + backward of one attention call of ``shard``'s queries."""
    meta = build_attention_metadata(shard, "sdpa")
    leaves = [t.detach().requires_grad_(True) for t in (q, k_local, v_local, k_row, v_row)]
    start = time.perf_counter()
    out = attention_over_row(*leaves, meta)
    out.sum().backward()
    return time.perf_counter() - start


def no_gather(x: torch.Tensor) -> torch.Tensor:
    """A simulated rank's all_gather: the simulation hands attention the whole rows itself."""
    raise AssertionError("a simulated context-parallel rank gathered")


def qkv(length: int, size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    local = length // size
    q = torch.randn(1, local, HEADS, HEAD_DIM, generator=g)
    k_local, v_local = (torch.randn(1, local, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    k_row, v_row = (torch.randn(1, length, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    return q, k_local, v_local, k_row, v_row


def simulated_attention(length: int, timing_rows: int) -> list[dict]:
    """Each rank's attention alone, 1 thread, balancers interleaved row by row."""
    torch.set_num_threads(1)
    attention_seconds(context_shard(make_batch(length), 0, 2, no_gather), *qkv(length, 2))
    results = []
    for size in SIZES:
        tensors = qkv(length, size)
        per_rank = {name: np.zeros(size) for name, _, _ in BALANCERS}
        slowest = {name: [] for name, _, _ in BALANCERS}
        for seed in range(timing_rows):
            batch = make_batch(length, seed=seed)
            for name, how, rounds in BALANCERS:
                times = [
                    attention_seconds(
                        context_shard(batch, r, size, no_gather, balance=how, rounds=rounds),
                        *tensors,
                    )
                    for r in range(size)
                ]
                per_rank[name] += np.array(times) / timing_rows
                slowest[name].append(max(times))
        row = {"L": length, "ranks": size, "timing_rows": timing_rows}
        for name in per_rank:
            row[name] = {
                "slowest_rank_s": statistics.fmean(slowest[name]),
                "mean_rank_s": float(per_rank[name].mean()),
                "per_rank_s": per_rank[name].tolist(),
            }
        results.append(row)
    return results


def gloo_attention_worker(rank, length, timing_rows, repeats, port, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    q, k, v, _, _ = qkv(length, 2, seed=rank)
    times = {name: [] for name, _, _ in BALANCERS}
    for seed in range(timing_rows):
        batch = make_batch(length, seed=seed)
        for repeat in range(repeats + 1):  # the first pass warms up
            for name, how, rounds in BALANCERS:
                shard = context_shard(
                    batch, rank, 2, all_gather_over(group), balance=how, rounds=rounds
                )
                meta = build_attention_metadata(shard, "sdpa")
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                dist.barrier()
                start = time.perf_counter()
                out = context_attention(*leaves, meta)  # the K/V all-gather included
                out.sum().backward()  # reduce-scatters the rows' K/V gradient
                if repeat:
                    times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    queue.put((rank, {name: statistics.median(t) for name, t in times.items()}))


def gloo_attention(length: int, timing_rows: int, repeats: int) -> dict:
    """Two real ranks: per balancer, each rank's median seconds (gather included)."""
    results = run_ranks(gloo_attention_worker, 2, (length, timing_rows, repeats), length)
    row = {"L": length, "ranks": 2, "timing_rows": timing_rows, "repeats": repeats}
    for name, _, _ in BALANCERS:
        per_rank = [results[r][name] for r in range(2)]
        row[name] = {"slowest_rank_s": max(per_rank), "per_rank_s": per_rank}
    return row


def run_ranks(target, size: int, args: tuple, salt: int) -> dict:
    """Run ``target(rank, *args, port, queue)`` in ``size`` fresh processes; rank -> result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + (os.getpid() + salt + size) % 2000
    procs = [ctx.Process(target=target, args=(r, *args, port, queue)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return results


# --------------------------------------------------------------------------- 3. step
def tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", attn_backend="sdpa", max_seq_len=131072))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def step_worker(rank, size, how, rounds, length, steps, port, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, 2 // size))  # the same 2 cores whatever the rank count
    group = None
    if size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=size)
        group = dist.group.WORLD
    batch = make_batch(length, seed=0)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):  # one warm-up step first
        start = time.perf_counter()  # the plan is made every step, as in training
        if size > 1:
            shard = context_shard(
                batch, rank, size, all_gather_over(group), balance=how, rounds=rounds
            )
        data_parallel_step(model, shard if size > 1 else batch, opt, group)
        if step:
            times.append(time.perf_counter() - start)
    if size > 1:
        dist.destroy_process_group()
    queue.put((rank, {"step_s": statistics.median(times), "peak_rss_gib": peak_rss_gib()}))


def time_step(length: int, size: int, name: str, how: str, rounds: int, steps: int) -> dict:
    results = run_ranks(step_worker, size, (size, how, rounds, length, steps), length + rounds)
    step_s = max(r["step_s"] for r in results.values())  # a step ends with its slowest rank
    return {
        "L": length,
        "ranks": size,
        "balance": name if size > 1 else "one process",
        "steps": steps,
        "step_s": step_s,
        "tokens_per_s": length / step_s,
        "peak_rss_gib_per_rank": max(r["peak_rss_gib"] for r in results.values()),
    }


def time_steps(length: int, quick: bool, repeats: int) -> list[dict]:
    """One process, then 2 ranks per balancer (at 128k and in --quick: head_tail and
    documents only), in ``repeats`` round-robin passes; each config's fastest pass (the
    machine is shared: the minimum is the least disturbed)."""
    steps = 1 if quick or length > 65536 else 2
    few = quick or length > 65536
    configs = [(1, "one process", DEFAULT_BALANCE, 1)]
    configs += [(2, *b) for b in BALANCERS if not few or b[0] in ("head_tail", "documents")]
    passes = [[time_step(length, size, *c, steps=steps) for size, *c in configs]
              for _ in range(repeats)]  # fmt: skip
    best = [min(runs, key=lambda r: r["step_s"]) for runs in zip(*passes, strict=True)]
    for row, runs in zip(best, zip(*passes, strict=True), strict=True):
        row["passes_step_s"] = [r["step_s"] for r in runs]
    return best


# --------------------------------------------------------------------------- 4. communication
def gather_bytes_per_layer(length: int, size: int, kv_heads: int, head_dim: int, nbytes: int):
    """Bytes one rank receives per layer in the forward K and V all-gather (one row)."""
    return 2 * length * (size - 1) // size * kv_heads * head_dim * nbytes


def communication(lengths) -> list[dict]:
    return [
        {
            "shape": shape,
            "L": n,
            "ranks": size,
            "mib_per_layer": gather_bytes_per_layer(n, size, *spec[:3]) / 2**20,
            "gib_per_step_forward": gather_bytes_per_layer(n, size, *spec[:3]) * spec[3] / 2**30,
        }
        for shape, spec in SHAPES.items()
        for n in lengths
        for size in (2, 8)
    ]


# --------------------------------------------------------------------------- report
def print_tables(report: dict) -> None:
    names = [name for name, _, _ in BALANCERS]
    print("\nwork imbalance, max / mean over ranks of in-document causal pairs: mean / worst row;")
    print("pieces of split documents per rank; the planner's expected mean in brackets")
    print(f"{'L':>7} {'ranks':>5} " + " ".join(f"{n:>28}" for n in names))
    for b in report["balance"]:
        cells = " ".join(
            f"{b[n]['max_mean']['mean']:>6.3f} /{b[n]['max_mean']['worst']:>6.3f} "
            f"{b[n]['pieces_per_rank']:>5.1f}p [{b[n]['planner_expected_max_mean']:.3f}]"
            for n in names
        )
        print(f"{b['L']:>7} {b['ranks']:>5} {cells}")
    print("\nwork imbalance, max / min over ranks: mean / worst row")
    print(f"{'L':>7} {'ranks':>5} " + " ".join(f"{n:>15}" for n in names))
    for b in report["balance"]:
        cells = " ".join(
            f"{b[n]['max_min']['mean']:>7.3f} /{b[n]['max_min']['worst']:>6.3f}" for n in names
        )
        print(f"{b['L']:>7} {b['ranks']:>5} {cells}")
    print("\nattention fwd+bwd of one layer, seconds: slowest rank / mean rank (1 thread per rank)")
    print(f"{'L':>7} {'ranks':>5} {'how':>10} " + " ".join(f"{n:>17}" for n in names))
    for a in report["gloo_attention"]:
        cells = " ".join(f"{a[n]['slowest_rank_s']:>8.3f} /      -" for n in names)
        print(f"{a['L']:>7} {a['ranks']:>5} {'gloo':>10} {cells}")
    for a in report["simulated_attention"]:
        cells = " ".join(
            f"{a[n]['slowest_rank_s']:>8.3f} /{a[n]['mean_rank_s']:>7.3f}" for n in names
        )
        print(f"{a['L']:>7} {a['ranks']:>5} {'per rank':>10} {cells}")
    print("\ntraining step, tiny model, one row (2 cores: 1 process x 2 threads or 2 x 1)")
    print(f"{'L':>7} {'ranks':>5} {'balance':>11} {'step s':>8} {'tokens/s':>9} {'RSS GiB':>8}")
    for s in report["steps"]:
        print(
            f"{s['L']:>7} {s['ranks']:>5} {s['balance']:>11} {s['step_s']:>8.2f} "
            f"{s['tokens_per_s']:>9.0f} {s['peak_rss_gib_per_rank']:>8.2f}"
        )
    for n in sorted({s["L"] for s in report["steps"]}):
        by = {s["balance"]: s for s in report["steps"] if s["L"] == n}
        if "head_tail" in by:
            for name in names[1:]:
                if name in by:
                    ratio = by[name]["step_s"] / by["head_tail"]["step_s"]
                    print(f"L={n}: 2-rank step, {name} / head_tail = {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=2048, few rows, few steps")
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--step-lengths", type=int, nargs="+", default=None)
    parser.add_argument("--rows", type=int, default=None, help="rows per balance measurement")
    parser.add_argument("--timing-rows", type=int, default=1, help="rows timed per balancer")
    parser.add_argument("--step-repeats", type=int, default=None, help="passes over the configs")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    quick = args.quick
    lengths = args.lengths or ([2048] if quick else [32768, 131072])
    step_lengths = args.step_lengths or ([2048] if quick else [32768])
    rows = args.rows or (4 if quick else 16)
    step_repeats = args.step_repeats or (1 if quick else 2)
    out = args.out or RESULTS / ("cp_quick.json" if quick else "cp.json")

    started = time.perf_counter()
    report = {
        "balance": [balance(n, size, rows) for n in lengths for size in SIZES],
        "gloo_attention": [gloo_attention(n, args.timing_rows, 1 if quick else 2) for n in lengths],
        "simulated_attention": [
            r for n in lengths for r in simulated_attention(n, args.timing_rows)
        ],
        "comm": communication(lengths),
        "steps": [],
    }
    for n in step_lengths:
        report["steps"] += time_steps(n, quick, step_repeats)
    report["config"] = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "documents": DOCUMENTS,
        "model": "tiny (dim 256, 4 layers, 4 heads, 2 KV heads, head dim 64), sdpa, fp32",
        "load_average_at_end": os.getloadavg(),
        "wall_s": time.perf_counter() - started,
    }
    print_tables(report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
