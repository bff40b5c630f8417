"""Training-step cost of the HF adapter: a transformers LlamaForCausalLM run through longctx's
attention function and chunked loss, against the same weights in longctx's own Llama.

Both: sdpa backend (per-document SDPA), one packed row of lognormal-length documents,
continuous position ids, forward + backward + AdamW, 2 threads. The two implementations
alternate step by step so a change in the machine's load hits both alike; the median step is
reported. The difference is the adapter's overhead (HF module structure, kwargs plumbing).

    .venv/bin/python benchmarks/bench_hf_adapter.py            # L = 4k, 16k -> results/hf_adapter.json
    .venv/bin/python benchmarks/bench_hf_adapter.py --steps 2 --lengths 4096
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from longctx.batch import PackedBatch
from longctx.hf.adapter import load_hf_causal_lm
from longctx.hf.weight_source import load_hf

RESULTS = Path(__file__).parent / "results"
SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)


def make_batch(length: int, seed: int = 0, median: float = 600.0) -> PackedBatch:
    """One row of lognormal-length documents, the last one cut to fit; continuous positions."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < length:
        n = int(math.exp(math.log(median) + torch.randn(1, generator=g).item()))
        n = max(2, min(n, length - total))
        lens.append(n)
        total += n
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, length), generator=g)
    return PackedBatch.from_lengths(tokens, [lens], reset_position_ids=False)


def save_checkpoint(folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(folder)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: PackedBatch) -> float:
    start = time.perf_counter()
    loss_sum, num_tokens = model.loss(batch)
    (loss_sum / num_tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench_length(folder: str, length: int, steps: int) -> dict:
    models = {
        "hf_adapter": load_hf_causal_lm(folder, attn_backend="sdpa"),
        "longctx_llama": load_hf(folder, attn_backend="sdpa"),
    }
    batch = make_batch(length)
    with torch.no_grad():  # same weights, same batch: the losses must agree
        losses = {k: float(m.loss(batch)[0]) / batch.num_loss_tokens for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times = {k: [] for k in models}
    for i in range(steps + 1):  # step 0 warms up
        for name in sorted(models, reverse=i % 2 == 1):  # alternate who goes first
            t = step(models[name], opts[name], batch)
            if i:
                times[name].append(t)
    row = {"seq_len": length, "documents": batch.num_segments, "initial_loss": losses}
    for name, ts in times.items():
        row[name] = {"median_step_s": statistics.median(ts), "tokens_per_s": length / min(ts)}
        row[name]["tokens_per_s_median"] = length / statistics.median(ts)
    ratio = row["hf_adapter"]["median_step_s"] / row["longctx_llama"]["median_step_s"]
    row["adapter_overhead"] = ratio - 1.0
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'L':>6} {'docs':>5} {'impl':>14} {'step s':>8} {'tok/s':>8}  overhead")
    for r in rows:
        for name in ("longctx_llama", "hf_adapter"):
            over = f"{r['adapter_overhead']:+.1%}" if name == "hf_adapter" else ""
            res = r[name]
            print(
                f"{r['seq_len']:>6} {r['documents']:>5} {name:>14} {res['median_step_s']:>8.3f} "
                f"{res['tokens_per_s_median']:>8.0f}  {over}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "hf_adapter.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder)
        rows = [bench_length(folder, n, args.steps) for n in args.lengths]
    print_table(rows)
    meta = {
        "threads": 2,
        "backend": "sdpa",
        "positions": "continuous",
        "steps": args.steps,
        "shape": SHAPE,
        "torch": torch.__version__,
        "caveat": "shared 2-core CPU machine under load from other users; medians of "
        "alternating steps, absolute numbers noisy",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
