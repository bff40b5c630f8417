"""The context-extension recipe's cost, estimated from a few steps (scripts/context_extension.sh).

    .venv/bin/python benchmarks/bench_context_extension.py [--steps 4] [--steps1 600 --steps2 150]

Times a few training steps of each stage (the tiny model on the embedded corpus: stage 1 is
8 rows of 256, stage 2 one row of 2048) and one forward pass of a long held-out document at
8192, in process CPU seconds (time.process_time: what the run costs, less sensitive to other
processes on the machine than wall time) and wall seconds, then extrapolates the recipe:
training steps, the validations (val rows + long documents), and the evaluation of each arm.
Prints a table and writes benchmarks/results/context_extension.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import torch

from longctx.data import DataConfig, LongCtxDataModule
from longctx.eval.long_documents import load_long_documents, probe_lengths
from longctx.eval.ruler.generate import DEFAULT_DEPTHS
from longctx.model import Llama, LlamaConfig

RESULTS = Path(__file__).parent / "results" / "context_extension.json"
ARMS, EVAL_FACTOR = 4, 4


def timed(fn, repeats: int) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) per call, after one warm-up call."""
    fn()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.process_time() - cpu) / repeats, (time.perf_counter() - wall) / repeats


def train_step_cost(seq_len: int, rows: int, steps: int) -> tuple[float, float]:
    model = Llama(LlamaConfig.from_name("tiny", rope_theta=10000.0, attn_backend="sdpa"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dm = LongCtxDataModule(DataConfig(seq_len=seq_len, micro_batch_size=rows))
    dm.setup("fit")
    batches = itertools.cycle(list(itertools.islice(iter(dm.train_dataloader()), steps + 1)))

    def step() -> None:
        loss_sum, count = model.loss(next(batches))
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, steps)


@torch.no_grad()
def forward_cost(length: int, repeats: int) -> tuple[float, float]:
    """One forward of a held-out book cut at ``length`` tokens."""
    from longctx.eval.documents import document_batches

    model = Llama(LlamaConfig.from_name("tiny", rope_theta=10000.0, attn_backend="sdpa")).eval()
    docs = load_long_documents(DataConfig())[:1]
    (batch, _), *_ = document_batches(docs, length, 1, pad_id=256)
    return timed(lambda: model.token_loss(batch), repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per stage")
    p.add_argument("--steps1", type=int, default=600)
    p.add_argument("--steps2", type=int, default=150)
    p.add_argument("--probe-samples", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    stage1 = train_step_cost(256, 8, args.steps)
    stage2 = train_step_cost(2048, 1, args.steps)
    long_doc = forward_cost(EVAL_FACTOR * 2048, 2)
    # a forward costs about its tokens: per token at 8192 (attention grows a little with length)
    per_token = tuple(c / (EVAL_FACTOR * 2048) for c in long_doc)
    docs = len(load_long_documents(DataConfig()))
    validation = (4 * 2048 + docs * EVAL_FACTOR * 2048) * 3  # 3 validations per arm
    probes = sum(probe_lengths(2048, EVAL_FACTOR)) * len(DEFAULT_DEPTHS) * args.probe_samples
    evaluation = 4 * 2048 + docs * EVAL_FACTOR * 2048 + probes
    rows = []
    for kind, i in (("cpu_s", 0), ("wall_s", 1)):
        parts = {
            "stage1_train": args.steps1 * stage1[i],
            "stage2_train": ARMS * args.steps2 * stage2[i],
            "stage2_validation": ARMS * validation * per_token[i],
            "evaluation": ARMS * evaluation * per_token[i],
        }
        rows.append({"measure": kind, **parts, "total": sum(parts.values())})
    print(f"per step: stage 1 {stage1[0]:.2f} CPU s / {stage1[1]:.2f} wall s; stage 2 "
          f"{stage2[0]:.2f} / {stage2[1]:.2f}; forward at 8192: {long_doc[0]:.2f} / "
          f"{long_doc[1]:.2f}; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'':8}" + "".join(f"{k:>19}" for k in rows[0] if k != "measure"))
    for r in rows:
        print(f"{r['measure']:8}" + "".join(f"{v:>19.0f}" for k, v in r.items() if k != "measure"))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {
                    "cpu": platform.processor(),
                    "threads": torch.get_num_threads(),
                    "load_average": os.getloadavg()[0],
                },  # fmt: skip
                "per_step": {"stage1": stage1, "stage2": stage2, "forward_8192": long_doc},
                "recipe": {"steps1": args.steps1, "steps2": args.steps2, "arms": ARMS},
                "estimate_seconds": rows,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
