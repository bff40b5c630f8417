"""Packing benchmark: planning speed, row assembly throughput, packing efficiency.

Document lengths are lognormal (median ~600 tokens, sigma 1.2, clipped to [1, 32768]). For each
packer and L in {8192, 131072}:

- planning: the lengths-only planner on 1,000,000 documents (rows, efficiency, splits);
- assembly: ``pack()`` copying real tokens out of a memory-mapped uint32 token file into rows
  (rows only), and the same followed by ``collate_rows`` into PackedBatch (reset position ids,
  document mask, BATCH_TOKENS tokens per batch), on >= 100 M tokens.

Single thread (torch.set_num_threads(1)). Times are reported as CPU time of this process
(``time.process_time``) and wall time: on a shared machine the wall clock also counts other
people's work. Writes benchmarks/results/packing.json.

    python benchmarks/bench_packing.py            # full run (1 M documents, ~100 M tokens)
    python benchmarks/bench_packing.py --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from packing_plans import plan_rows

from longctx.data.packing import PackingStats, collate_rows, make_packer

PACKERS = ("concat_chunk", "best_fit")
SEQ_LENS = (8192, 131072)
EOS_ID = 0
VOCAB = 50_000
BATCH_TOKENS = 65_536  # rows per collated batch: max(1, BATCH_TOKENS // L)
RESULTS = Path(__file__).parent / "results" / "packing.json"


def document_lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(mean=np.log(600), sigma=1.2, size=count))
    return np.clip(lengths, 1, 32768).astype(np.int64)


class Clock:
    """CPU time and wall time of a block."""

    def __enter__(self) -> Clock:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu = time.process_time() - self.cpu0
        self.wall = time.perf_counter() - self.wall0


def bench_planning(name: str, seq_len: int, lengths: list[int]) -> dict:
    with Clock() as clock:
        plan, stats = plan_rows(name, lengths, seq_len)
    return {
        "packer": name,
        "seq_len": seq_len,
        "documents": len(lengths),
        "rows": len(plan),
        "cpu_s": clock.cpu,
        "wall_s": clock.wall,
        "docs_per_s": len(lengths) / clock.cpu,
        **stats_fields(stats),
    }


def stats_fields(stats: PackingStats) -> dict:
    """A planning result's statistics, without the rows the result already counts."""
    fields = dataclasses.asdict(stats) | {
        "efficiency": stats.efficiency,
        "docs_per_row": stats.docs_per_row,
    }
    del fields["rows"]
    return fields


def write_token_file(directory: Path, lengths: np.ndarray, seed: int = 1) -> Path:
    """A uint32 token file: random ids, every document ending in EOS."""
    rng = np.random.default_rng(seed)
    path = directory / "tokens.u32"
    tokens = np.memmap(path, dtype=np.uint32, mode="w+", shape=(int(lengths.sum()),))
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        size = min(chunk, len(tokens) - start)
        tokens[start : start + size] = rng.integers(1, VOCAB, size=size, dtype=np.uint32)
    tokens[np.cumsum(lengths) - 1] = EOS_ID
    tokens.flush()
    del tokens
    return path


def bench_assembly(name: str, seq_len: int, path: Path, lengths: np.ndarray, collate: bool) -> dict:
    """pack() over documents sliced from the memory-mapped file; optionally collate batches."""
    # np.asarray drops the memmap subclass (cheaper slicing); the pages stay file-backed.
    tokens = np.asarray(np.memmap(path, dtype=np.uint32, mode="r"))
    ends = np.cumsum(lengths)
    documents = (tokens[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist(), strict=True))
    packer = make_packer(name, seq_len)
    rows_per_batch = max(1, BATCH_TOKENS // seq_len)
    with Clock() as clock:
        rows = []
        for row in packer.pack(documents):
            rows.append(row)
            if len(rows) == rows_per_batch:
                if collate:
                    collate_rows(rows, reset_position_ids=True, document_mask=True)
                rows = []
        if rows and collate:
            collate_rows(rows, reset_position_ids=True, document_mask=True)
    row_tokens = packer.stats.tokens
    return {
        "packer": name,
        "seq_len": seq_len,
        "collate": collate,
        "row_tokens": row_tokens,
        "rows_per_batch": rows_per_batch,
        "cpu_s": clock.cpu,
        "wall_s": clock.wall,
        "tokens_per_s_cpu": row_tokens / clock.cpu,
        "tokens_per_s_wall": row_tokens / clock.wall,
        "efficiency": packer.stats.efficiency,
    }


def print_table(planning: list[dict], rows_only: list[dict], batches: list[dict]) -> None:
    docs = planning[0]["documents"]
    print(
        f"\n{'packer':<13}{'L':>7} | {f'plan {docs} docs':>16} {'eff %':>7} {'docs/row':>8} "
        f"{'splits':>7} | {'rows M tok/s':>12} {'+collate M tok/s':>16}  (cpu / wall)"
    )
    for plan, rows, full in zip(planning, rows_only, batches, strict=True):
        print(
            f"{plan['packer']:<13}{plan['seq_len']:>7} | {plan['cpu_s']:>14.2f} s "
            f"{100 * plan['efficiency']:>7.3f} {plan['docs_per_row']:>8.2f} {plan['splits']:>7} | "
            f"{rows['tokens_per_s_cpu'] / 1e6:>5.0f} / {rows['tokens_per_s_wall'] / 1e6:<4.0f} "
            f"{full['tokens_per_s_cpu'] / 1e6:>9.0f} / {full['tokens_per_s_wall'] / 1e6:<4.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k documents, ~10 M tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plan_docs = 100_000 if args.quick else 1_000_000
    min_tokens = 10_000_000 if args.quick else 100_000_000

    plan_lengths = document_lengths(plan_docs).tolist()
    planning = [bench_planning(n, s, plan_lengths) for s in SEQ_LENS for n in PACKERS]

    asm_lengths = document_lengths(plan_docs * 4, seed=1)
    asm_lengths = asm_lengths[: int(np.searchsorted(np.cumsum(asm_lengths), min_tokens)) + 1]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_token_file(Path(tmp), asm_lengths)
        configs = [(n, s) for s in SEQ_LENS for n in PACKERS]
        rows_only = [bench_assembly(n, s, path, asm_lengths, collate=False) for n, s in configs]
        batches = [bench_assembly(n, s, path, asm_lengths, collate=True) for n, s in configs]

    print_table(planning, rows_only, batches)
    result = {
        "quick": args.quick,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "torch_threads": torch.get_num_threads(),
        "lengths": "lognormal(log 600, 1.2) clipped to [1, 32768]",
        "assembly_tokens_in_file": int(asm_lengths.sum()),
        "planning": planning,
        "assembly_rows_only": rows_only,
        "assembly_with_collate": batches,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
