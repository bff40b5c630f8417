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


def one_run(preset: str, length: int, chunk: int | None, steps: int) -> dict:
    """In this process: ``steps`` timed steps after one warm-up step."""
    import numpy as np
    import torch

    from longctx.batch import PackedBatch
    from longctx.model import LlamaConfig
    from longctx.train.cpu_memory import retain_freed_memory

    retain_freed_memory()
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
    }


def measure(preset: str, length: int, chunk: int | None, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--one", f"{preset}:{length}:{chunk or ''}",
           "--steps", str(steps)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps after a warm-up")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # preset:L:chunk, in a child process
    args = ap.parse_args()
    if args.one:
        preset, length, chunk = args.one.split(":")
        print(json.dumps(one_run(preset, int(length), int(chunk) if chunk else None, args.steps)))
        return
    import torch

    rows = []
    for preset, length, chunk in RUNS:
        rows.append(measure(preset, length, chunk, args.steps))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "what": __doc__.splitlines()[0],
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "steps_timed": args.steps,
        "rows": rows,
    }  # fmt: skip
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
