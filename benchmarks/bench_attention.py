"""CPU benchmark of document-masked attention, forward + backward, side by side.

For one row of L tokens packed with lognormal document lengths (median 600, sigma 1, clipped
to L), H=4, Hkv=2, D=64 (the tiny model), B=1, fp32, 2 threads, it times:

- sdpa:   the `sdpa` backend (document buckets), metadata built outside the timed region;
- ideal:  one SDPA fwd+bwd call per document on views of the same tensors, as one loop (no
          gather, scatter or gradient accumulation: the kernels' cost alone);
- dense:  one SDPA call with a dense block-diagonal causal bool mask (n/a above --dense-max);
- flex:   the `flex` backend forward only (CPU has no FlexAttention backward; uncompiled on
          CPU it materialises the scores, so only up to --flex-max, default 4096).

A second set of rows uses tiny documents (median 30) where a per-document loop is dominated by
per-call overhead. Each round times every method once, in turn; the best of the rounds is kept.

    .venv/bin/python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx.batch import DENSE_MASK_MAX_LEN, PackedBatch
from longctx.model.attention import attention, build_attention_metadata

H, HKV, D = 4, 2, 64
RESULTS = Path(__file__).parent / "results" / "attention.json"


def lognormal_lengths(length: int, median: float, sigma: float, seed: int) -> list[int]:
    """Document lengths filling exactly `length` tokens; the last document is cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < length:
        draw = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=gen)))
        lengths.append(max(1, min(round(draw), length - sum(lengths))))
    return lengths


def make_inputs(length: int, lengths: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch = PackedBatch.from_lengths(torch.zeros(1, length, dtype=torch.long), [lengths], True)
    q = torch.randn(1, length, H, D, generator=gen).requires_grad_(True)
    k = torch.randn(1, length, HKV, D, generator=gen).requires_grad_(True)
    v = torch.randn(1, length, HKV, D, generator=gen).requires_grad_(True)
    grad_out = torch.randn(1, length, H, D, generator=gen)
    return batch, q, k, v, grad_out


# ----------------------------------------------------------------------------- methods
def run_sdpa_backend(batch, q, k, v, grad_out, meta):
    attention(q, k, v, meta).backward(grad_out)


def run_ideal_loop(batch, q, k, v, grad_out, docs):
    """One fwd+bwd SDPA call per document, nothing else: docs are per-document leaf views."""
    for q_1HnD, k_1HnD, v_1HnD, g_1HnD in docs:
        out_1HnD = F.scaled_dot_product_attention(
            q_1HnD, k_1HnD, v_1HnD, is_causal=True, enable_gqa=True
        )
        out_1HnD.backward(g_1HnD)


def per_document_views(q, k, v, grad_out, lengths):
    """Views of the same tensors, one leaf per document: backward writes only that document's
    gradient (slicing the whole-row leaf instead would add a full-size zero tensor per doc)."""
    docs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        leaves = [x[:, sl].transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
        docs.append((*leaves, grad_out[:, sl].transpose(1, 2)))
        start += n
    return docs


def run_dense_mask(batch, q, k, v, grad_out, mask_11LL):
    out_1HLD = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask_11LL,
        enable_gqa=True,
    )
    out_1HLD.backward(grad_out.transpose(1, 2))


def run_flex_forward(batch, q, k, v, grad_out, meta):
    with torch.no_grad():
        attention(q, k, v, meta)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- one case
def bench_case(length: int, lengths: list[int], rounds: int, dense_max: int, flex_max: int) -> dict:
    batch, q, k, v, grad_out = make_inputs(length, lengths)
    t0 = time.perf_counter()
    sdpa_meta = build_attention_metadata(batch, "sdpa")
    meta_s = time.perf_counter() - t0
    methods = {
        "sdpa": (run_sdpa_backend, sdpa_meta),
        "ideal": (run_ideal_loop, per_document_views(q, k, v, grad_out, lengths)),
    }
    if length <= dense_max:
        mask = batch.to_dense_mask().unsqueeze(1) if length <= DENSE_MASK_MAX_LEN else None
        methods["dense"] = (run_dense_mask, mask if mask is not None else _dense_mask(batch))
    if length <= min(flex_max, DENSE_MASK_MAX_LEN):
        methods["flex_fwd"] = (run_flex_forward, build_attention_metadata(batch, "flex"))
    times: dict[str, list[float]] = {name: [] for name in methods}
    for fn, extra in methods.values():  # warm-up
        fn(batch, q, k, v, grad_out, extra)
    for _ in range(rounds):
        for name, (fn, extra) in methods.items():
            times[name].append(timed(fn, batch, q, k, v, grad_out, extra))
    best = {name: min(ts) for name, ts in times.items()}
    return {
        "L": length,
        "n_docs": len(lengths),
        "max_doc": max(lengths),
        "sdpa_buckets": len(sdpa_meta.sdpa_plan.bucket_shapes),
        "sdpa_metadata_s": meta_s,
        "best_s": best,
        "all_s": times,
        "sdpa_over_ideal": best["sdpa"] / best["ideal"],
        "dense_over_sdpa": best["dense"] / best["sdpa"] if "dense" in best else None,
    }


def _dense_mask(batch: PackedBatch) -> torch.Tensor:
    """Block-diagonal causal bool mask [1, 1, L, L] beyond to_dense_mask()'s test limit."""
    doc = batch.doc_ids[0]
    length = doc.numel()
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


# ----------------------------------------------------------------------------- report
def fmt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:9.1f}"


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'docs':>6} {'L':>6} {'n_docs':>6} {'bkts':>5} {'sdpa ms':>9} {'ideal ms':>9} "
        f"{'dense ms':>9} {'flexfwd ms':>10} {'sdpa/ideal':>10} {'dense/sdpa':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        b = r["best_s"]
        dense_ratio = "n/a" if r["dense_over_sdpa"] is None else f"{r['dense_over_sdpa']:.1f}x"
        print(
            f"{r['docs']:>6} {r['L']:>6} {r['n_docs']:>6} {r['sdpa_buckets']:>5} "
            f"{fmt(b['sdpa'])} {fmt(b['ideal'])} {fmt(b.get('dense'))} "
            f"{fmt(b.get('flex_fwd')):>10} {r['sdpa_over_ideal']:>9.2f}x {dense_ratio:>10}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 4k, 8k only; 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dense-max", type=int, default=16384, help="largest L for the dense mask")
    parser.add_argument(
        "--flex-max", type=int, default=4096, help="largest L for uncompiled CPU flex (slow)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    sizes = [4096, 8192] if args.quick else [4096, 8192, 16384, 32768, 65536]
    rounds = 2 if args.quick else args.rounds
    rows = []
    for docs, median in (("med600", 600), ("med30", 30)):
        for length in sizes if docs == "med600" else sizes[-2:]:
            lengths = lognormal_lengths(length, median, sigma=1.0, seed=length)
            row = {
                "docs": docs,
                **bench_case(length, lengths, rounds, args.dense_max, args.flex_max),
            }
            rows.append(row)
            print(f"done {docs} L={length}", flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "H": H,
        "Hkv": HKV,
        "D": D,
        "B": 1,
        "dtype": "float32",
        "threads": 2,
        "lengths": "lognormal sigma=1, clipped to L",
        "rounds": rounds,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "load_average_at_end": os.getloadavg(),
    }
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
