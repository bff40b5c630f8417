"""Context parallelism on CPU: work balance per rank, communication per layer, step time.

1. Balance: in-document attention work (query-key pairs inside documents, proportional to
   FLOPs) of every rank, max/min over the ranks, for rows of lognormal documents (median 600,
   sigma 1.0), with longctx's head-tail chunks (rank r: chunks r and 2N-1-r) in k rounds
   against a plain contiguous split (rank r: the r-th N-th of the row). Pure arithmetic on the
   shards.
2. Communication: bytes each rank receives per layer in the forward all-gather of K and V
   (the backward reduce-scatter sends as many), for the tiny model and the Llama 3 8B shape in
   bf16, and the measured time of that gather for the tiny shape on 2 gloo processes.
3. Step time: forward + backward + gradient all-reduce + AdamW of the tiny model on one row of L
   tokens, 1 process with 2 threads vs. 2 gloo processes (context_parallel=2, 1 and many
   rounds) with 1 thread each: the same 2 cores. Each configuration runs in a fresh process group of subprocesses,
   so peak RSS is per rank.

    .venv/bin/python benchmarks/bench_cp.py                 # L = 32k, 128k -> results/cp.json
    .venv/bin/python benchmarks/bench_cp.py --lengths 8192  # quick
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

from longctx.batch import PackedBatch
from longctx.distributed.context_parallel import context_shard, gather_row
from longctx.model import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from bench_step import data_parallel_step, make_batch  # noqa: E402  (lognormal documents)

RESULTS = Path(__file__).parent / "results"
SHAPES = {  # (KV heads, head dim, bytes per element, layers)
    "tiny fp32": (2, 64, 4, 4),
    "llama3_8b bf16": (8, 128, 2, 32),
}


# --------------------------------------------------------------------------- balance
def keys_per_query(batch: PackedBatch) -> np.ndarray:
    """[L] keys each query of row 0 attends to: its position inside its document, plus one."""
    lens = batch.seq_lens[0][batch.seq_lens[0] > 0].numpy().astype(np.int64)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    return np.arange(lens.sum()) - starts + 1


def balance(length: int, size: int, rows: int, rounds: tuple[int, ...]) -> dict:
    """max/min work per rank for each number of head-tail rounds and a contiguous split."""
    ratios = {f"head_tail_k{k}": [] for k in rounds} | {"contiguous": []}
    for seed in range(rows):
        batch = make_batch(length, seed=seed)
        work = keys_per_query(batch)
        for k in rounds:
            shards = [context_shard(batch, r, size, rounds=k) for r in range(size)]
            per_rank = [work[s.global_index.numpy()].sum() for s in shards]
            ratios[f"head_tail_k{k}"].append(max(per_rank) / min(per_rank))
        blocks = work.reshape(size, -1).sum(1)
        ratios["contiguous"].append(blocks.max() / blocks.min())
    row = {"L": length, "ranks": size, "rows": rows}
    for name, values in ratios.items():
        row[name] = {"mean": statistics.fmean(values), "worst": float(max(values))}
    return row


def gather_bytes_per_layer(length: int, size: int, kv_heads: int, head_dim: int, nbytes: int):
    """Bytes one rank receives per layer in the forward K and V all-gather (one row)."""
    return 2 * length * (size - 1) // size * kv_heads * head_dim * nbytes


# --------------------------------------------------------------------------- timing
def tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", attn_backend="sdpa", max_seq_len=131072))


def train_steps(model: Llama, batch, steps: int, group=None) -> list[float]:
    """Seconds per step (one warm-up step first); gradients all-reduced over ``group``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        data_parallel_step(model, batch, opt, group)
        if step:
            times.append(time.perf_counter() - start)
    return times


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rank_worker(rank, size, rounds, length, steps, port, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, 2 // size))  # the same 2 cores whatever the rank count
    if size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=size)
    group = dist.group.WORLD if size > 1 else None
    batch = make_batch(length, seed=0)
    shard = context_shard(batch, rank, size, group, rounds) if size > 1 else batch
    times = train_steps(tiny_model(), shard, steps, group)
    result = {"rank": rank, "step_s": statistics.median(times), "peak_rss_gib": peak_rss_gib()}
    if size > 1:
        kv_heads, head_dim = 2, 64  # tiny
        k_local = torch.randn(1, shard.shape[1], kv_heads, head_dim)
        start = time.perf_counter()
        for _ in range(5):
            gather_row(k_local, group, size, rounds)
        result["gather_one_tensor_ms"] = (time.perf_counter() - start) / 5 * 1e3
        dist.destroy_process_group()
    queue.put(result)


def time_config(length: int, size: int, rounds: int, steps: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + (os.getpid() + length + size + rounds) % 2000
    procs = [
        ctx.Process(target=rank_worker, args=(r, size, rounds, length, steps, port, queue))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
    row = {
        "L": length,
        "ranks": size,
        "rounds": rounds,
        "step_s": max(r["step_s"] for r in results),  # a step ends when its slowest rank does
        "tokens_per_s": length / max(r["step_s"] for r in results),
        "peak_rss_gib_per_rank": max(r["peak_rss_gib"] for r in results),
    }
    if size > 1:  # K and V: two such gathers per layer
        row["gather_kv_per_layer_ms"] = 2 * max(r["gather_one_tensor_ms"] for r in results)
    return row


# --------------------------------------------------------------------------- report
def print_tables(balances: list[dict], comm: list[dict], steps: list[dict]) -> None:
    print("\nwork balance: max/min in-document attention pairs per rank, mean / worst row")
    names = [k for k in balances[0] if k.startswith("head_tail") or k == "contiguous"]
    print(f"{'L':>7} {'ranks':>5} " + " ".join(f"{n:>17}" for n in names))
    for b in balances:
        cells = " ".join(f"{b[n]['mean']:>8.3f} /{b[n]['worst']:>7.3f}" for n in names)
        print(f"{b['L']:>7} {b['ranks']:>5} {cells}")
    print("\nforward K+V all-gather per layer, received by each rank (backward sends as much)")
    print(f"{'shape':>15} {'L':>7} {'ranks':>5} {'MiB/layer':>10} {'GiB/step fwd':>13}")
    for c in comm:
        print(
            f"{c['shape']:>15} {c['L']:>7} {c['ranks']:>5} {c['mib_per_layer']:>10.1f} "
            f"{c['gib_per_step_forward']:>13.2f}"
        )
    print("\ntraining step, tiny model, one row (2 cores: 1 process x 2 threads or 2 x 1)")
    print(
        f"{'L':>7} {'ranks':>5} {'rounds':>6} {'step s':>8} {'tokens/s':>9} {'RSS GiB':>8} "
        f"{'KV gather ms':>13}"
    )
    for s in steps:
        gather = s.get("gather_kv_per_layer_ms")
        print(
            f"{s['L']:>7} {s['ranks']:>5} {s['rounds']:>6} {s['step_s']:>8.2f} "
            f"{s['tokens_per_s']:>9.0f} {s['peak_rss_gib_per_rank']:>8.2f} "
            f"{'' if gather is None else f'{gather:.1f}':>13}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16, help="rows per balance measurement")
    parser.add_argument("--rounds", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--out", type=Path, default=RESULTS / "cp.json")
    args = parser.parse_args()

    rounds = tuple(args.rounds)
    balances = [balance(n, size, args.rows, rounds) for n in args.lengths for size in (2, 4, 8)]
    comm = [
        {
            "shape": shape,
            "L": n,
            "ranks": size,
            "mib_per_layer": gather_bytes_per_layer(n, size, *spec[:3]) / 2**20,
            "gib_per_step_forward": gather_bytes_per_layer(n, size, *spec[:3]) * spec[3] / 2**30,
        }
        for shape, spec in SHAPES.items()
        for n in args.lengths
        for size in (2, 8)
    ]
    configs = [(1, 1)] + [(2, k) for k in dict.fromkeys((rounds[0], rounds[-1]))]
    steps = [time_config(n, size, k, args.steps) for n in args.lengths for size, k in configs]
    print_tables(balances, comm, steps)
    for n in args.lengths:
        one, *two = (s for s in steps if s["L"] == n)
        for s in two:
            print(
                f"L={n}: 2 ranks ({s['rounds']} round(s)) / 1 rank: step time "
                f"{s['step_s'] / one['step_s']:.2f}x, peak RSS per rank "
                f"{s['peak_rss_gib_per_rank'] / one['peak_rss_gib_per_rank']:.2f}x"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "documents": "lognormal median 600 sigma 1.0, one row per batch (bench_step.make_batch)",
        "load_average_at_end": os.getloadavg(),
    }
    args.out.write_text(
        json.dumps({"config": config, "balance": balances, "comm": comm, "steps": steps}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
