"""What Llama 3's 128,256-id vocabulary costs: a training step (forward + backward + AdamW, fp32,
sdpa, document masking, reset positions) of ``tiny`` (512 ids) against ``tiny_llama3`` (the same
body, 128,256 ids) at L = 2048 and 8192, micro-batch 1, and ``tiny_llama3`` with its loss in one
chunk (unchunked logits) at 2048 for what chunking saves.

Each (preset, L) runs in a fresh subprocess, so ru_maxrss is that run's peak RSS; freed memory
is kept for reuse as train.py does on CPU. Rows are documents of 100..2000 tokens with ids
drawn uniformly from the vocabulary (the step's cost does not depend on the ids).

    nice -n 10 .venv/bin/python benchmarks/bench_vocab.py   # -> benchmarks/results/vocab.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vocab.json"
RUNS = [
    ("tiny", 2048, None),
    ("tiny_llama3", 2048, None),
    ("tiny_llama3", 2048, 131072),  # the loss in one chunk: whole-row logits
    ("tiny", 8192, None),
    ("tiny_llama3", 8192, None),
]


def one_run(preset: str, length: int, chunk: int | None, steps: int, threads: int) -> dict:
    """In this process: ``steps`` timed steps after one warm-up step."""
    import numpy as np
    import torch

    from longctx.batch import PackedBatch
    from longctx.model import LlamaConfig
    from longctx.train.cpu_memory import retain_freed_memory

    retain_freed_memory()
    torch.set_num_threads(threads)  # 1 by default: steady on a shared machine
    torch.manual_seed(0)
    config = LlamaConfig.from_name(preset, attn_backend="sdpa", loss_chunk_size=chunk)
    model = config.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(min(rng.integers(100, 2000), length - sum(lengths))))
    tokens = torch.as_tensor(rng.integers(0, config.vocab_size, (1, length)))
    batch = PackedBatch.from_lengths(tokens, [lengths], reset_position_ids=True)
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        loss_sum, count = model.loss(batch)
        loss = loss_sum / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step allocates AdamW's state: a warm-up
            times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "preset": preset,
        "L": length,
        "vocab_size": config.vocab_size,
        "loss_chunk_size": config.loss_chunk_size,
        "parameters": config.num_params(),
        "step_s": statistics.median(times),
        "steps": times,
        "tokens_per_s": length / statistics.median(times),
        "peak_rss_gib": rss / 2**30,
        "loss": float(loss),
        "threads": threads,
    }


LOSS_RUNS = [(2048, "retain"), (8192, "retain"), (2048, "default"), (8192, "default")]


def loss_only(tokens: int, malloc: str) -> dict:
    """In this process: the chunked loss alone at 128,256 ids (dim 256, chunks of 1024), forward
    and backward, under train.py's CPU allocator setting ("retain") or glibc's default."""
    import torch

    from longctx.model.loss import chunked_token_loss
    from longctx.train.cpu_memory import retain_freed_memory

    if malloc == "retain":
        retain_freed_memory()
    torch.set_num_threads(1)
    weight = (torch.randn(128256, 256) * 0.02).requires_grad_()
    hidden = torch.randn(tokens, 256, requires_grad=True)
    labels = torch.randint(0, 128256, (tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    chunked_token_loss(hidden, weight, labels, 1024).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens": tokens, "malloc": malloc, "chunks": -(-tokens // 1024),
            "rss_before_gib": before / 2**30, "peak_rss_gib": peak / 2**30}  # fmt: skip


def measure(preset: str, length: int, chunk: int | None, steps: int, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--one", f"{preset}:{length}:{chunk or ''}",
           "--steps", str(steps), "--threads", str(threads)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def loss_table(rows: list[dict]) -> str:
    lines = ["| loss alone: tokens | chunks of 1024 | allocator | peak RSS (GiB) |",
             "|---:|---:|---|---:|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['tokens']:,} | {r['chunks']} | {r['malloc']} | {r['peak_rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    base = {r["L"]: r for r in rows if r["preset"] == "tiny"}
    lines = [
        "| model | vocab | L | loss chunk | step (s) | tokens/s | peak RSS (GiB) | step vs tiny |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["step_s"] / base[r["L"]]["step_s"] if r["L"] in base else float("nan")
        lines.append(
            f"| {r['preset']} | {r['vocab_size']:,} | {r['L']:,} | {r['loss_chunk_size']:,} | "
            f"{r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['peak_rss_gib']:.2f} | "
            f"{ratio:.1f}x |"
        )
    return "\n".join(lines)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # preset:L:chunk, in a child process
    ap.add_argument("--loss", help=argparse.SUPPRESS)  # tokens:malloc, in a child process
    ap.add_argument("--loss-only", action="store_true", help="only the loss rows (into the JSON)")
    args = ap.parse_args()
    if args.loss:
        tokens, malloc = args.loss.split(":")
        print(json.dumps(loss_only(int(tokens), malloc)))
        return
    if args.one:  # before the loss rows: a step's child process runs only its step
        preset, length, chunk = args.one.split(":")
        chunk_size = int(chunk) if chunk else None
        print(json.dumps(one_run(preset, int(length), chunk_size, args.steps, args.threads)))
        return
    loss_rows = [_child(["--loss", f"{n}:{m}"]) for n, m in LOSS_RUNS]
    print(loss_table(loss_rows))
    if args.loss_only:
        result = json.loads(RESULTS.read_text())
        RESULTS.write_text(json.dumps({**result, "loss_rows": loss_rows}, indent=2) + "\n")
        return
    rows = []
    for preset, length, chunk in RUNS:
        rows.append(measure(preset, length, chunk, args.steps, args.threads))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "what": __doc__.splitlines()[0],
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(),
                    "load_average_at_end": os.getloadavg()},
        "steps_timed": args.steps,
        "rows": rows,
        "loss_rows": loss_rows,
    }  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
