"""Greedy generation speed: longctx's KV-cache decoding against transformers' ``generate`` on the
same weights saved as a transformers folder (what ``--hf`` and longctx.hf.export give), and
against recomputing the whole sequence for every new token (no cache).

The `tiny` preset's shape (dim 256, 4 layers, GQA 4/2 heads, vocab 512), random weights, fp32,
one prompt (batch 1) of each length, greedy, no stop token; 1 thread (on the oversubscribed
shared CPU this ran on, 2 threads made every small matmul wait for the other one). Generated
tokens per second count only the new tokens (prefill included in the time: a RULER instance
pays it once). The
implementations alternate run by run so a change in the machine's load hits both; the median
of the runs is reported. Every method writes the same tokens (checked).

    .venv/bin/python benchmarks/bench_generate.py                  # -> results/generate.json
    .venv/bin/python benchmarks/bench_generate.py --lengths 512 --new 32 --runs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from uncached_generate import recompute_generate

from longctx.model import Llama, LlamaConfig
from longctx.model.generate import greedy_generate

RESULTS = Path(__file__).parent / "results"


def models(folder: Path):
    """(longctx's Llama, the same weights as a transformers LlamaForCausalLM)."""
    from transformers import AutoModelForCausalLM

    from longctx.hf.checkpoint import save_hf

    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", attn_backend="sdpa", exact_rope_angles=False)
    model = Llama(config).eval()
    save_hf(model, folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, hf


def hf_generate(hf, prompt: torch.Tensor, new: int) -> list[int]:
    out = hf.generate(
        input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]), do_sample=False,
        num_beams=1, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def timed(fn) -> tuple[float, list[int]]:
    start = time.perf_counter()
    with torch.no_grad():
        tokens = fn()
    return time.perf_counter() - start, tokens


def bench(length: int, new: int, recompute_new: int, runs: int, model, hf) -> dict:
    prompt = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(length))
    methods = {
        "longctx_kv_cache": (lambda: greedy_generate(model, prompt, new), new),
        "transformers_generate": (lambda: hf_generate(hf, prompt, new), new),
        "longctx_recompute": (lambda: recompute_generate(model, prompt, recompute_new),
                              recompute_new),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in methods}
    tokens: dict[str, list[int]] = {}
    for _ in range(runs):
        for name, (fn, _) in methods.items():
            seconds, tokens[name] = timed(fn)
            times[name].append(seconds)
    reference = tokens["longctx_kv_cache"]
    same = {name: t == reference[: len(t)] for name, t in tokens.items()}
    row = {"prompt": length, "new_tokens": new, "same_tokens": same}
    for name, (_, count) in methods.items():
        median = statistics.median(times[name])
        row[name] = {"seconds": median, "new": count, "tokens_per_s": count / median}
    return row


def table(rows: list[dict]) -> str:
    names = ("longctx_kv_cache", "transformers_generate", "longctx_recompute")
    lines = [
        "| prompt | new | " + " | ".join(f"{n} tok/s" for n in names) + " | cache / HF |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        rates = [r[n]["tokens_per_s"] for n in names]
        ratio = rates[0] / rates[1]
        cells = " | ".join(f"{x:.1f}" for x in rates)
        lines.append(f"| {r['prompt']} | {r['new_tokens']} | {cells} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[512, 2048])
    p.add_argument("--new", type=int, default=32, help="tokens generated (cached, HF)")
    p.add_argument("--recompute-new", type=int, default=8, help="tokens generated without cache")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "generate.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf = models(Path(tmp) / "hf")
        rows = [bench(n, args.new, args.recompute_new, args.runs, model, hf) for n in args.lengths]
    result = {
        "what": "greedy generation, batch 1, fp32, tiny preset shape, 1 thread (CPU)",
        "threads": 1,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
