"""Data pipeline throughput: prepare (MB of text/s) and DataModule (tokens/s delivered).

    .venv/bin/python benchmarks/bench_data.py [--quick]

Prints a table and writes benchmarks/results/data.json. Measures on the embedded corpus
(King James chapters, 4.3 MB); the DataModule loop only touches each batch (no model), so the
number is what the input pipeline can feed a training loop.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from longctx.data import DataConfig, LongCtxDataModule
from longctx.data.corpus import default_corpus_dir
from longctx.data.prepare import prepare
from longctx.io import atomic_write_bytes

RESULTS = Path(__file__).parent / "results" / "data.json"


def bench_prepare(source: Path, workers: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        prepare(
            [source], Path(tmp) / "out", "byte", workers=workers, val_fraction=0.05, progress=False
        )
        seconds = time.perf_counter() - start
    mb = source.stat().st_size / 1e6
    return {"stage": "prepare", "workers": workers, "seconds": seconds, "mb_per_s": mb / seconds}


def bench_datamodule(folder: Path, seq_len: int, workers: int, packer: str, tokens: int) -> dict:
    dm = LongCtxDataModule(
        DataConfig(
            shards=[str(folder)],
            seq_len=seq_len,
            micro_batch_size=1,
            packer=packer,
            num_workers=workers,
            num_streams=2,
        )
    )
    dm.setup("fit")
    batches = max(4, tokens // seq_len)
    start, delivered, first = time.perf_counter(), 0, None
    for i, batch in enumerate(dm.train_dataloader()):
        delivered += batch.tokens.numel()
        first = first or time.perf_counter() - start
        if i + 1 == batches:
            break
    seconds = time.perf_counter() - start
    return {
        "stage": "datamodule",
        "seq_len": seq_len,
        "workers": workers,
        "packer": packer,
        "batches": i + 1,
        "seconds": seconds,
        "first_batch_s": first,
        "tokens_per_s": delivered / seconds,
    }


def bench_resume(folder: Path, seq_len: int) -> dict:
    """Cost of resuming a stream mid-chunk (replays at most chunk_documents documents)."""
    config = DataConfig(shards=[str(folder)], seq_len=seq_len, micro_batch_size=1, num_streams=1)
    dm = LongCtxDataModule(config)
    it = iter(dm.train_dataloader())
    for _ in range(200):
        next(it)
    resumed = LongCtxDataModule(config)
    resumed.load_state_dict(dm.state_dict())
    start = time.perf_counter()
    next(iter(resumed.train_dataloader()))
    return {
        "stage": "resume",
        "seq_len": seq_len,
        "after_batches": 200,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer tokens per measurement")
    args = parser.parse_args()
    folder = default_corpus_dir()
    source = folder.parent / f"{folder.name}.jsonl"
    tokens = 2_000_000 if args.quick else 8_000_000
    rows = [bench_prepare(source, w) for w in (1, 2)]
    for seq_len in (8192, 131072):
        for workers in (0, 2):
            for packer in ("best_fit",) if args.quick else ("best_fit", "concat_chunk"):
                rows.append(bench_datamodule(folder, seq_len, workers, packer, tokens))
    rows.append(bench_resume(folder, 8192))
    print_table(rows)
    meta = {
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "corpus_mb": source.stat().st_size / 1e6,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS, json.dumps({"meta": meta, "rows": rows}, indent=2).encode())
    print(f"wrote {RESULTS}")


def print_table(rows: list[dict]) -> None:
    print(f"{'stage':<11}{'L':>8}{'workers':>8}{'packer':>14}{'seconds':>9}  throughput")
    for r in rows:
        if r["stage"] == "prepare":
            what = f"{r['mb_per_s']:.2f} MB text/s"
        elif r["stage"] == "resume":
            what = f"resume after {r['after_batches']} batches"
        else:
            what = (
                f"{r['tokens_per_s'] / 1e3:,.0f}k tokens/s (first batch {r['first_batch_s']:.2f} s)"
            )
        print(
            f"{r['stage']:<11}{r.get('seq_len', ''):>8}{r.get('workers', ''):>8}"
            f"{r.get('packer', ''):>14}{r['seconds']:>9.2f}  {what}"
        )


if __name__ == "__main__":
    main()
