"""Data-parallel balance, predicted: Llama 3 8B on H100, the step's rows before and after
longctx.data.dp_balance reorders them over (rank, micro-batch) slots.

Per length mix, documents are packed into rows by the best_fit packer (benchmarks/packing_plans.py
plan_rows, buffer 1000, seed 0; one stream, rows in the order it emits them). Step s of a
configuration (R data-parallel ranks x M accumulation micro-batches x 1 row) trains rows
[s * R * M, (s + 1) * R * M); unbalanced, in round m rank r takes the step's micro-batch
m * R + r (longctx/data/streams.py). A row costs the planner's roofline
(``longctx.planner.dp_balance.row_cost_for``: training FLOPs over 989 TFLOP/s x MFU 0.40), divided by the
context-parallel size that docs/planner.md's table needs on H100 (1 at 32k, 2 at 128k).

Mixes: ``corpus`` (the embedded corpus's documents, epochs in seeded permutations, as the
streams draw them); ``long_tail`` (Pareto lengths: 256 x (1 + Lomax(1.1)), at most 1M tokens);
``prolong`` (books, lognormal median 100k sigma 0.7, 40% of tokens, among web documents,
lognormal median 500 sigma 1.0). Per configuration, means over STEPS steps of: max / mean rank
cost (unbalanced, LPT alone, balanced), the lower bound on it (no assignment does better), and
the predicted step: the most loaded rank (ranks meet once per step) and the sum over rounds of
the costliest micro-batch (ranks meet every micro-batch, as under FSDP2); the balancing time
per step (wall, this CPU: costs from seq_lens and the assignment). At 8 ranks x 4 micro-batches
the first OPTIMUM_STEPS steps are also solved exactly (a MILP, scipy's HiGHS; its dual bound
where the time limit stops it), to say how far the balancer is from the best assignment where
the bound is loose: ``optimum`` (after_over_optimum_max over the steps solved, 1.0 = optimal;
after_over_dual_bound_max over the MILP's dual bound where it was not solved in time).

    .venv/bin/python benchmarks/bench_dp_balance.py     # -> results/dp_balance.json, ~1 min

``--measure``: measured on this CPU, 2 gloo ranks (forked, one thread each), a tiny Llama
(dim 64, 1 layer, 2 heads of 32) with document-masked SDPA (per-document, no L x L mask), rows
of L = 16k packed (best_fit) from the long-tailed mix, MEASURE_ACCUMULATION rows per rank per
step (one row per micro-batch). Each of MEASURE_STEPS steps runs unbalanced and balanced in turn
(which goes first alternates), timed from a barrier to the end of the gradient all-reduce (the
step time: the slowest rank). Per micro-batch, its seconds and the row's sum of squared
document lengths are kept to check the cost model: a least-squares fit of
t = a + c x sum(l^2) (every row has L tokens, so the linear term is the constant a), against
the planner's ratio of linear to attention FLOPs for this model.

    .venv/bin/python benchmarks/bench_dp_balance.py --measure   # -> results/dp_balance_measured.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from packing_plans import plan_rows
from scipy.optimize import Bounds, LinearConstraint, milp

from longctx import planner
from longctx.batch import PackedBatch
from longctx.data.corpus import default_corpus_dir
from longctx.data.dp_balance import (
    RowCost,
    balance_step,
    max_lower_bound,
    unbalanced_step,
)
from longctx.data.shards import ShardSet
from longctx.io import atomic_write_bytes
from longctx.model import Llama, LlamaConfig
from longctx.planner.dp_balance import row_cost_for, row_flops

RESULTS = Path(__file__).parent / "results" / "dp_balance.json"
MEASURED = Path(__file__).parent / "results" / "dp_balance_measured.json"
MEASURE_LENGTH = 16384
MEASURE_RANKS = 2
MEASURE_ACCUMULATION = 4
MEASURE_STEPS = 12
MEASURE_MODEL = dict(
    dim=64, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=128, vocab_size=256,
    max_seq_len=MEASURE_LENGTH, attn_backend="sdpa",
)  # fmt: skip
LENGTHS = (32768, 131072)
CONTEXT_PARALLEL = {32768: 1, 131072: 2}  # Llama 3 8B on H100: results/planning_table.json
RANKS = (8, 64)
ACCUMULATION = (1, 4)
ROWS_PER_MICRO_BATCH = 1  # docs/planner.md's table: one row per micro-batch
STEPS = 20
TARGET = 1.05
OPTIMUM_STEPS = 3  # steps solved exactly at 8 ranks x 4 micro-batches
OPTIMUM_TIME_LIMIT_S = 5
MIXES = ("corpus", "long_tail", "prolong")


def document_lengths(mix: str, tokens: int, seed: int = 0) -> np.ndarray:
    """At least ``tokens`` tokens of documents of the mix, in stream order."""
    rng = np.random.default_rng(seed)
    if mix == "corpus":
        corpus = ShardSet(default_corpus_dir()).document_lengths().astype(np.int64)
        epochs = -(-tokens // int(corpus.sum()))
        return np.concatenate([corpus[rng.permutation(len(corpus))] for _ in range(epochs)])
    lengths, total = [], 0
    while total < tokens:
        batch = draw(mix, rng, 100_000)
        lengths.append(batch)
        total += int(batch.sum())
    return np.concatenate(lengths)


def draw(mix: str, rng, n: int) -> np.ndarray:
    if mix == "long_tail":
        return np.minimum(256 * (1 + rng.pareto(1.1, n)), 2**20).astype(np.int64)
    # prolong: a document is a book with the probability that gives books 40% of the tokens
    book_mean, web_mean = 100_000 * np.exp(0.7**2 / 2), 500 * np.exp(1.0**2 / 2)
    p_book = 0.4 * web_mean / (0.4 * web_mean + 0.6 * book_mean)
    books = rng.lognormal(np.log(100_000), 0.7, n)
    web = rng.lognormal(np.log(500), 1.0, n)
    return np.maximum(1, np.where(rng.random(n) < p_book, books, web)).astype(np.int64)


def packed_rows(mix: str, length: int, rows: int) -> np.ndarray:
    """[rows, S] segment lengths (zero padded) of the mix's first ``rows`` best_fit rows."""
    lengths = document_lengths(mix, tokens=int(rows * length * 1.05))
    plan, _ = plan_rows("best_fit", lengths.tolist(), length)
    if len(plan) < rows:
        raise RuntimeError(f"{mix} at {length}: {len(plan)} rows packed, {rows} needed")
    plan = plan[:rows]
    seq_lens = np.zeros((rows, max(len(r) for r in plan)), dtype=np.int64)
    for i, pieces in enumerate(plan):
        seq_lens[i, : len(pieces)] = [piece[2] for piece in pieces]
    return seq_lens


def measure(seq_lens: np.ndarray, cost, ranks: int, micro: int) -> dict:
    per_step = ranks * micro * ROWS_PER_MICRO_BATCH
    steps = []
    for s in range(STEPS):
        lens = seq_lens[s * per_step : (s + 1) * per_step]
        started = time.perf_counter()
        costs = cost.costs(lens)
        plan = balance_step(costs, ranks, micro, ROWS_PER_MICRO_BATCH)
        balance_ms = (time.perf_counter() - started) * 1e3
        lpt = balance_step(costs, ranks, micro, ROWS_PER_MICRO_BATCH, improve=False)
        before = unbalanced_step(costs, ranks, micro, ROWS_PER_MICRO_BATCH)
        bound = max_lower_bound(costs, ranks, micro * ROWS_PER_MICRO_BATCH)
        steps.append({
            "before": before.imbalance, "lpt": lpt.imbalance, "after": plan.imbalance,
            "bound": bound / before.rank_costs.mean(),
            "step_before_s": before.step_time, "step_after_s": plan.step_time,
            "rounds_before_s": before.round_synced_step_time,
            "rounds_after_s": plan.round_synced_step_time,
            "balance_ms": balance_ms,
        })  # fmt: skip
        if ranks == 8 and micro == 4 and s < OPTIMUM_STEPS:
            best, solved = proven_bound(costs, ranks, micro, plan.step_time, bound)
            steps[-1]["after_over_optimum"] = plan.step_time / max(bound, best)
            steps[-1]["solved"] = solved
    mean = {k: statistics.fmean(s[k] for s in steps) for k in steps[-1]}
    checked = [s for s in steps if "solved" in s]
    optimum = {
        "steps_checked": len(checked),
        "steps_solved": sum(s["solved"] for s in checked),
        "after_over_optimum_max": max(
            (s["after_over_optimum"] for s in checked if s["solved"]), default=None
        ),
        "after_over_dual_bound_max": max(
            (s["after_over_optimum"] for s in checked if not s["solved"]), default=None
        ),
    }
    return {
        "imbalance": {k: mean[k] for k in ("before", "lpt", "after", "bound")},
        "imbalance_worst": {k: max(s[k] for s in steps) for k in ("before", "after", "bound")},
        "steps_bound_above_target": sum(int(s["bound"] > TARGET) for s in steps),
        "steps_after_above_target": sum(int(s["after"] > TARGET) for s in steps),
        "step_s": {"before": mean["step_before_s"], "after": mean["step_after_s"]},
        "speedup": mean["step_before_s"] / mean["step_after_s"],
        "round_synced_step_s": {"before": mean["rounds_before_s"], "after": mean["rounds_after_s"]},
        "round_synced_speedup": mean["rounds_before_s"] / mean["rounds_after_s"],
        "balance_ms": {"mean": mean["balance_ms"], "max": max(s["balance_ms"] for s in steps)},
        "balance_fraction_of_step": mean["balance_ms"] / 1e3 / mean["step_after_s"],
    } | ({"optimum": optimum} if checked else {})


def proven_bound(
    costs: np.ndarray, ranks: int, rows_per_rank: int, found: float, bound: float
) -> tuple[float, bool]:
    """(a lower bound on the least possible most-loaded rank, whether it is that optimum): a
    MILP (x[i, r] = row i on rank r, minimise t with every row on one rank, rows_per_rank rows
    per rank, every rank's cost <= t), its dual bound when the time limit stops it; ``found``
    when that equals ``bound`` (then optimal, no MILP needed)."""
    if found <= bound * (1 + 1e-9):
        return found, True
    n = len(costs)
    objective = np.zeros(n * ranks + 1)
    objective[-1] = 1.0
    one_rank = np.kron(np.eye(n), np.ones(ranks))  # [n, n * ranks]
    per_rank = np.kron(np.ones(n), np.eye(ranks))  # [ranks, n * ranks]
    load = np.kron(costs, np.eye(ranks))
    constraints = [
        LinearConstraint(np.hstack([one_rank, np.zeros((n, 1))]), 1, 1),
        LinearConstraint(np.hstack([per_rank, np.zeros((ranks, 1))]), rows_per_rank, rows_per_rank),
        LinearConstraint(np.hstack([load, -np.ones((ranks, 1))]), -np.inf, 0),
    ]
    integrality = np.r_[np.ones(n * ranks), 0]
    upper = np.r_[np.ones(n * ranks), np.inf]
    result = milp(
        objective, constraints=constraints, integrality=integrality, bounds=Bounds(0, upper),
        options={"time_limit": OPTIMUM_TIME_LIMIT_S},
    )  # fmt: skip
    if result.status == 0:
        return float(result.fun), True
    return float(result.mip_dual_bound), False


def main() -> None:
    started = time.perf_counter()
    config = LlamaConfig.from_name("llama3_8b")
    device = planner.known_device("H100")
    rows_needed = STEPS * max(RANKS) * max(ACCUMULATION) * ROWS_PER_MICRO_BATCH
    results = []
    for mix in MIXES:
        for length in LENGTHS:
            seq_lens = packed_rows(mix, length, rows_needed)
            base = row_cost_for(config, device, planner.DEFAULT_MFU)
            cost = type(base)(*(c / CONTEXT_PARALLEL[length] for c in (
                base.linear_per_token, base.attention_per_sq_token)))  # fmt: skip
            for ranks in RANKS:
                for micro in ACCUMULATION:
                    results.append(
                        {"mix": mix, "L": length, "ranks": ranks, "accumulation": micro,
                         "context_parallel": CONTEXT_PARALLEL[length]}
                        | measure(seq_lens, cost, ranks, micro)
                    )  # fmt: skip
                    print_row(results[-1], header=len(results) == 1)
    meta = {
        "model": "llama3_8b",
        "device": "H100 (planner.known_device: 989e12 dense bf16 FLOP/s)",
        "mfu": planner.DEFAULT_MFU,
        "cost": "dp_balance.row_cost_for / context_parallel: the planner's compute roofline",
        "packing": "best_fit, buffer 1000, seed 0, one stream; 1 row per micro-batch",
        "steps": STEPS,
        "target": TARGET,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }
    atomic_write_bytes(RESULTS, json.dumps({"meta": meta, "rows": results}, indent=1).encode())
    print(f"wrote {RESULTS} in {meta['seconds']:.0f} s (load average {os.getloadavg()[0]:.1f})")


def print_row(r: dict, header: bool) -> None:
    if header:
        print(
            f"{'mix':>9} {'L':>7} {'DP':>3} {'acc':>3} | max/mean before  LPT  after bound | "
            f"step s before  after  x  | FSDP2 x | balance ms  % step"
        )
    i, s = r["imbalance"], r["step_s"]
    print(
        f"{r['mix']:>9} {r['L']:>7} {r['ranks']:>3} {r['accumulation']:>3} | "
        f"{i['before']:>15.3f} {i['lpt']:>5.3f} {i['after']:>5.3f} {i['bound']:>5.3f} | "
        f"{s['before']:>13.2f} {s['after']:>6.2f} {r['speedup']:>4.2f} | "
        f"{r['round_synced_speedup']:>7.2f} | {r['balance_ms']['mean']:>10.2f} "
        f"{100 * r['balance_fraction_of_step']:>6.3f}",
        flush=True,
    )


# --------------------------------------------------------------------------- measured (CPU)
def measure_worker(rank: int, seq_lens: np.ndarray, port: int, out: Path) -> None:
    """One gloo rank: every step unbalanced and balanced (alternating first), timed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=MEASURE_RANKS)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**MEASURE_MODEL))
    cost = RowCost(*row_flops(model.config))
    per_step = MEASURE_RANKS * MEASURE_ACCUMULATION
    steps, micro = [], []
    timed_step(model, seq_lens[:MEASURE_ACCUMULATION], rank, micro=[])  # warm-up
    for s in range(MEASURE_STEPS):
        lens = seq_lens[s * per_step : (s + 1) * per_step]
        args = (MEASURE_RANKS, MEASURE_ACCUMULATION, 1)
        plans = {"unbalanced": unbalanced_step(cost.costs(lens), *args),
                 "balanced": balance_step(cost.costs(lens), *args)}  # fmt: skip
        row = {"step": s}
        for name in sorted(plans, reverse=s % 2 == 1):  # alternate which runs first
            mine = lens[plans[name].slots[rank].reshape(-1)]
            row[name + "_s"] = timed_step(model, mine, rank, micro)
            row[name + "_imbalance"] = plans[name].imbalance
        steps.append(row)
    if rank == 0:
        out.write_text(json.dumps({"steps": steps}))
    gathered = [None] * MEASURE_RANKS
    dist.all_gather_object(gathered, micro)
    if rank == 0:
        data = json.loads(out.read_text())
        out.write_text(json.dumps(data | {"micro_batches": sum(gathered, [])}))
    dist.destroy_process_group()


def timed_step(model, rows: np.ndarray, rank: int, micro: list) -> float:
    """Seconds from a barrier to the end of the gradient all-reduce (the slowest rank's step);
    each micro-batch's own seconds appended to ``micro``."""
    model.zero_grad(set_to_none=True)
    dist.barrier()
    started = time.perf_counter()
    for lens in rows:
        lens = [int(n) for n in lens if n > 0]
        tokens = torch.randint(0, 256, (1, MEASURE_LENGTH))
        batch = PackedBatch.from_lengths(tokens, [lens], reset_position_ids=True)
        t = time.perf_counter()
        loss_sum, _ = model.loss(batch)
        loss_sum.backward()
        squares = float(sum(n * n for n in lens))
        micro.append({"rank": rank, "sum_sq": squares, "s": time.perf_counter() - t})
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return time.perf_counter() - started


def measure_main() -> None:
    started, load_before = time.perf_counter(), os.getloadavg()
    per_step = MEASURE_RANKS * MEASURE_ACCUMULATION
    seq_lens = packed_rows("long_tail", MEASURE_LENGTH, MEASURE_STEPS * per_step)
    out = MEASURED.with_suffix(".partial")
    port = 29000 + os.getpid() % 2000
    mp.start_processes(
        measure_worker, args=(seq_lens, port, out), nprocs=MEASURE_RANKS, start_method="fork"
    )
    data = json.loads(out.read_text())
    out.unlink()
    summary = measured_summary(data["steps"]) | {"cost_model": cost_fit(data["micro_batches"])}
    meta = {
        "model": MEASURE_MODEL, "L": MEASURE_LENGTH, "ranks": MEASURE_RANKS,
        "accumulation": MEASURE_ACCUMULATION, "rows_per_micro_batch": 1,
        "steps": MEASURE_STEPS, "mix": "long_tail, best_fit", "threads_per_rank": 1,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "seconds": time.perf_counter() - started,
    }  # fmt: skip
    atomic_write_bytes(
        MEASURED, json.dumps({"meta": meta, "summary": summary} | data, indent=1).encode()
    )
    print(json.dumps(summary, indent=1))
    print(f"wrote {MEASURED} in {meta['seconds']:.0f} s (load average {os.getloadavg()})")


def measured_summary(steps: list[dict]) -> dict:
    """Step time balanced vs unbalanced: the ratio of the sums, and the per-step ratios' spread
    (median, min, max; bootstrap 95% interval of the ratio of sums over steps)."""
    before = np.array([s["unbalanced_s"] for s in steps])
    after = np.array([s["balanced_s"] for s in steps])
    ratios = before / after
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(steps), (10_000, len(steps)))
    boot = before[picks].sum(axis=1) / after[picks].sum(axis=1)
    return {
        "step_s": {"unbalanced": float(before.mean()), "balanced": float(after.mean())},
        "speedup": float(before.sum() / after.sum()),
        "speedup_ci95": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))],
        "per_step_ratio": {
            "median": float(np.median(ratios)),
            "min": float(ratios.min()),
            "max": float(ratios.max()),
        },  # fmt: skip
        "predicted_imbalance": {
            "unbalanced": float(np.mean([s["unbalanced_imbalance"] for s in steps])),
            "balanced": float(np.mean([s["balanced_imbalance"] for s in steps])),
        },
    }


def cost_fit(micro: list[dict]) -> dict:
    """Least squares t = a + c * sum(l^2) over the measured micro-batches, against the
    planner's ratio (linear FLOPs of L tokens over attention FLOPs per squared token)."""
    x = np.array([m["sum_sq"] for m in micro])
    t = np.array([m["s"] for m in micro])
    (a, c), *_ = np.linalg.lstsq(np.c_[np.ones_like(x), x], t, rcond=None)
    predicted = a + c * x
    r2 = 1 - ((t - predicted) ** 2).sum() / ((t - t.mean()) ** 2).sum()
    linear, attention = row_flops(LlamaConfig(**MEASURE_MODEL))
    return {
        "fit_a_s": float(a), "fit_c_s_per_sq_token": float(c), "r2": float(r2),
        "fit_ratio_a_over_c": float(a / c),
        "planner_ratio_linear_L_over_attention": linear * MEASURE_LENGTH / attention,
        "implied_gflops_attention": attention / c / 1e9,
        "implied_gflops_linear": linear * MEASURE_LENGTH / a / 1e9,
        "micro_batches": len(micro),
    }  # fmt: skip


if __name__ == "__main__":
    measure_main() if "--measure" in sys.argv[1:] else main()
