"""What reset vs continuous position ids change, per row length: RoPE angle error and logit gaps.

For one row of lognormal documents (median 600 tokens) at each L, a randomly initialised model
(``tiny`` by default) computes logits four ways: {reset, continuous} positions x {document mask,
no mask}. Under the mask the two position modes are the same function (RoPE scores depend only
on in-document distances), so their logit gap is rounding; without it they are different models.
Both ways of computing RoPE angles are measured: ``fp32`` (position * inv_freq rounded in fp32, as
transformers does) and ``exact`` (the product in fp64, rounded once).

    python benchmarks/bench_rope_angles.py [--lengths 8192 32768 131072] [--out results/rope_angles.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from longctx.batch import PackedBatch
from longctx.model import Llama, LlamaConfig
from longctx.model.rope import inv_frequencies

RESULTS = Path(__file__).parent / "results"


def document_row(length: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    rng = np.random.default_rng(seed)
    lens, total = [], 0
    while total < length:
        n = int(min(max(rng.lognormal(math.log(600), 1.0), 16), length - total))
        lens.append(n)
        total += n
    tokens = torch.from_numpy(rng.integers(0, vocab, size=(1, length)))
    return tokens, lens


def angle_error(config: LlamaConfig, length: int) -> float:
    """max |fp32 angle - exact angle| (rad) over positions < length and all frequencies."""
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    positions = torch.arange(length)
    fp32 = positions.float()[:, None] * inv_freq
    exact = positions.double()[:, None] * inv_freq.double()
    return float((fp32.double() - exact).abs().max())


@torch.no_grad()
def logits(model: Llama, batch: PackedBatch, bf16: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(batch).float()


def arm_batches(
    tokens: torch.Tensor, lens: list[int], unmasked: bool
) -> dict[tuple[bool, bool], PackedBatch]:
    """(reset_position_ids, document_mask) -> batch; the unmasked arms keep the same labels."""
    out = {}
    for reset in (True, False):
        out[reset, True] = PackedBatch.from_lengths(tokens, [lens], reset)
        if unmasked:
            whole_row = torch.tensor([[tokens.shape[1]]], dtype=torch.int32)
            out[reset, False] = dataclasses.replace(out[reset, True], seq_lens=whole_row)
    return out


def measure(preset: str, length: int, seed: int, unmasked_max: int) -> list[dict]:
    config = LlamaConfig.from_name(preset, attn_backend="sdpa")
    tokens, lens = document_row(length, config.vocab_size, seed)
    batches = arm_batches(tokens, lens, unmasked=length <= unmasked_max)
    torch.manual_seed(seed)
    model = Llama(config).eval()
    rows = []
    for exact in (False, True):
        model.config = dataclasses.replace(config, exact_rope_angles=exact)
        for bf16 in (False, True):
            start = time.perf_counter()
            out = {arm: logits(model, b, bf16) for arm, b in batches.items()}
            masked_gap = (out[True, True] - out[False, True]).abs().max().item()
            unmasked_gap = (
                (out[True, False] - out[False, False]).abs().max().item()
                if (True, False) in out
                else None
            )
            rows.append(
                {
                    "L": length,
                    "docs": len(lens),
                    "angles": "exact" if exact else "fp32",
                    "precision": "bf16-autocast" if bf16 else "fp32",
                    "angle_error_rad": 0.0 if exact else angle_error(config, length),
                    "mean_abs_logit": out[True, True].abs().mean().item(),
                    "masked_gap": masked_gap,
                    "unmasked_gap": unmasked_gap,
                    "seconds": round(time.perf_counter() - start, 1),
                }
            )
            print_row(rows[-1])
    return rows


HEADER = "| L | docs | angles | precision | angle error (rad) | mean abs logit | masked gap | unmasked gap |"


def print_row(r: dict) -> None:
    print(
        f"| {r['L'] // 1024}k | {r['docs']} | {r['angles']} | {r['precision']} | "
        f"{r['angle_error_rad']:.1e} | {r['mean_abs_logit']:.3f} | {r['masked_gap']:.1e} | "
        f"{'n/a' if r['unmasked_gap'] is None else format(r['unmasked_gap'], '.2f')} |",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    # an unmasked row is one causal segment of L: quadratic work, slow on a CPU past 32k
    p.add_argument("--unmasked-max", type=int, default=32768)
    p.add_argument("--out", type=Path, default=RESULTS / "rope_angles.json")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    rows = [
        r
        for length in args.lengths
        for r in measure(args.preset, length, args.seed, args.unmasked_max)
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"preset": args.preset, "seed": args.seed, "torch": torch.__version__}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
