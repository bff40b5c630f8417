"""CPU benchmark of document-masked attention, forward + backward, side by side.

For a batch of B rows of L tokens, each packed with lognormal document lengths (median 600,
sigma 1.0 and 0.5; each row drawn with its own seed, its last document cut to fit), H=4, Hkv=2,
D=64 (the tiny model), fp32, 2 threads, it times the whole batch's forward + backward with:

- sdpa:   the `sdpa` backend (document buckets), metadata built outside the timed region;
- ideal:  one SDPA fwd+bwd call per document on views of the same tensors, as one loop, each
          document its own leaf (no output or gradient assembly: the kernels' cost alone);
- loop:   a plain per-document loop over split views with one cat and one backward (what a
          straightforward implementation pays, gradient assembly included);
- dense:  one SDPA call with a dense block-diagonal causal bool mask [B, 1, L, L] (n/a above
          --dense-max: 8k, the target's length, by default; it is slow, not only big);
- flex:   the `flex` backend forward only (CPU has no FlexAttention backward; uncompiled on
          CPU it materialises the scores, about 3 s for one 4k row: off by default,
          `--flex-max 4096 --batch-tokens 4096` times it on one 4k row).

B = max(1, --batch-tokens // L) rows (default 32k tokens: 8 rows at 4k, 4 at 8k, 1 from 32k),
so that one unlucky long document in a single short row does not decide a ratio. A third set uses
tiny documents (median 30), where a per-document loop pays per-call overhead.
Each round times every method once, in turn; the best of the rounds is kept. Wall time and
process CPU time are both recorded: on a shared machine the CPU-time ratios are the steadier.
"pairs/L2" is the in-document causal work as a fraction of the dense B*L*L: the dense mask's
disadvantage is about its inverse, so it depends on the document-length distribution; dense/ideal
is the most that any per-document method could gain over the dense mask on those rows.

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

# Idle OpenMP threads sleep instead of spinning, so CPU time measures work even on a shared
# machine (must be set before torch starts its thread pool).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from longctx.batch import DENSE_MASK_MAX_LEN, PackedBatch  # noqa: E402
from longctx.model.attention import attention, build_attention_metadata  # noqa: E402

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


def make_inputs(length: int, rows: list[list[int]], seed: int = 0):
    """A [B, L] batch with the given documents per row, and q/k/v/output-gradient tensors."""
    gen, b = torch.Generator().manual_seed(seed), len(rows)
    batch = PackedBatch.from_lengths(torch.zeros(b, length, dtype=torch.long), rows, True)
    q = torch.randn(b, length, H, D, generator=gen).requires_grad_(True)
    k = torch.randn(b, length, HKV, D, generator=gen).requires_grad_(True)
    v = torch.randn(b, length, HKV, D, generator=gen).requires_grad_(True)
    grad_out = torch.randn(b, length, H, D, generator=gen)
    return batch, q, k, v, grad_out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, L, heads, D] -> [1, B*L, heads, D]: documents never straddle rows."""
    return x.view(1, -1, *x.shape[2:])


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


def run_split_loop(batch, q, k, v, grad_out, lengths):
    """A plain per-document loop: split views of q/k/v, one SDPA call per document, cat the
    outputs, one backward. Pays what the backend pays to assemble the output and gradients,
    and one call per document."""
    q_docs, k_docs, v_docs = (_flat(x).split(lengths, dim=1) for x in (q, k, v))  # [1, n, ..]
    outs = [
        F.scaled_dot_product_attention(
            qd.transpose(1, 2), kd.transpose(1, 2), vd.transpose(1, 2), is_causal=True,
            enable_gqa=True,
        ).transpose(1, 2)  # 4-D: a 3-D [heads, n, D] input takes a much slower CPU path
        for qd, kd, vd in zip(q_docs, k_docs, v_docs, strict=True)
    ]  # fmt: skip
    torch.cat(outs, dim=1).backward(_flat(grad_out))


def per_document_views(q, k, v, grad_out, lengths):
    """Views of the same tensors, one leaf per document: backward writes only that document's
    gradient (slicing the whole-row leaf instead would add a full-size zero tensor per doc)."""
    docs, start = [], 0
    q, k, v, grad_out = (_flat(x) for x in (q, k, v, grad_out))
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


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


# ----------------------------------------------------------------------------- one case
def bench_case(length: int, rows: list[list[int]], args) -> dict:
    batch, q, k, v, grad_out = make_inputs(length, rows)
    lengths = [n for row in rows for n in row]  # documents in flat B*L order
    t0 = time.perf_counter()
    sdpa_meta = build_attention_metadata(batch, "sdpa")
    meta_s = time.perf_counter() - t0
    methods = {
        "sdpa": (run_sdpa_backend, sdpa_meta),
        "ideal": (run_ideal_loop, per_document_views(q, k, v, grad_out, lengths)),
        "loop": (run_split_loop, lengths),
    }
    if length <= args.dense_max:
        methods["dense"] = (run_dense_mask, _dense_mask(batch))
    if len(rows) * length <= args.flex_max and length <= DENSE_MASK_MAX_LEN:
        methods["flex_fwd"] = (run_flex_forward, build_attention_metadata(batch, "flex"))
    for fn, extra in methods.values():  # warm-up
        fn(batch, q, k, v, grad_out, extra)
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):  # interleaved: every method sees the same machine load
        for name, (fn, extra) in methods.items():
            w, c = timed(fn, batch, q, k, v, grad_out, extra)
            wall[name].append(w)
            cpu[name].append(c)
    best_wall = {name: min(ts) for name, ts in wall.items()}
    best_cpu = {name: min(ts) for name, ts in cpu.items()}
    plan = sdpa_meta.data.plan
    return {
        "L": length,
        "B": len(rows),
        "n_docs": len(lengths),
        "max_doc": max(lengths),
        # in-document causal query-key pairs as a fraction of the dense mask's B*L*L
        "pair_fraction": sum(n * n for n in lengths) / 2 / (len(rows) * length**2),
        "sdpa_calls": len(plan.bucket_shapes),
        "sdpa_padded_docs": sum(n for n, _ in plan.padded_shapes),
        "sdpa_metadata_s": meta_s,
        "best_wall_s": best_wall,
        "best_cpu_s": best_cpu,
        "all_wall_s": wall,
        "all_cpu_s": cpu,
        "sdpa_over_ideal_wall": best_wall["sdpa"] / best_wall["ideal"],
        "sdpa_over_ideal_cpu": best_cpu["sdpa"] / best_cpu["ideal"],
        "sdpa_over_loop_wall": best_wall["sdpa"] / best_wall["loop"],
        "dense_over_sdpa_wall": _ratio(best_wall, "dense", "sdpa"),
        "dense_over_sdpa_cpu": _ratio(best_cpu, "dense", "sdpa"),
        "dense_over_ideal_wall": _ratio(best_wall, "dense", "ideal"),
        "dense_over_ideal_cpu": _ratio(best_cpu, "dense", "ideal"),
    }


def _ratio(times: dict[str, float], num: str, den: str) -> float | None:
    return times[num] / times[den] if num in times else None


def _dense_mask(batch: PackedBatch) -> torch.Tensor:
    """Block-diagonal causal bool mask [B, 1, L, L] (to_dense_mask() stops at its test limit)."""
    doc_BL = batch.doc_ids
    length = doc_BL.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    return (causal & (doc_BL[:, :, None] == doc_BL[:, None, :]))[:, None]


# ----------------------------------------------------------------------------- report
def fmt_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"


def fmt_x(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def print_table(rows: list[dict]) -> None:
    """Wall ms (best of the rounds); ratios by wall time and, in brackets, by CPU time."""
    cols = [("docs", 11), ("L", 6), ("B", 2), ("n_docs", 6), ("max_doc", 7), ("pairs/L2", 8),
            ("calls", 5), ("sdpa ms", 8), ("ideal ms", 8), ("loop ms", 8), ("dense ms", 8),
            ("flexfwd ms", 10), ("sdpa/ideal [cpu]", 17), ("sdpa/loop", 9),
            ("dense/sdpa [cpu]", 17), ("dense/ideal [cpu]", 17)]  # fmt: skip
    header = " ".join(f"{name:>{width}}" for name, width in cols)
    print(header)
    print("-" * len(header))
    for r in rows:
        w = r["best_wall_s"]
        cells = [
            r["docs"], r["L"], r["B"], r["n_docs"], r["max_doc"], f"{r['pair_fraction']:.3f}",
            r["sdpa_calls"],
            fmt_ms(w["sdpa"]), fmt_ms(w["ideal"]), fmt_ms(w["loop"]), fmt_ms(w.get("dense")),
            fmt_ms(w.get("flex_fwd")),
            f"{fmt_x(r['sdpa_over_ideal_wall'])} [{fmt_x(r['sdpa_over_ideal_cpu'])}]",
            fmt_x(r["sdpa_over_loop_wall"]),
            f"{fmt_x(r['dense_over_sdpa_wall'])} [{fmt_x(r['dense_over_sdpa_cpu'])}]",
            f"{fmt_x(r['dense_over_ideal_wall'])} [{fmt_x(r['dense_over_ideal_cpu'])}]",
        ]  # fmt: skip
        print(" ".join(f"{str(c):>{width}}" for c, (_, width) in zip(cells, cols, strict=True)))


# (name, lognormal median, sigma, which L) -- sizes None = all
DOC_SETS = [("med600 s1.0", 600, 1.0, None), ("med600 s0.5", 600, 0.5, None),
            ("med30 s1.0", 30, 1.0, (8192, 32768, 65536))]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="L = 4k, 8k only; 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dense-max", type=int, default=8192, help="largest L for the dense mask")
    parser.add_argument(
        "--flex-max", type=int, default=0, help="largest B*L for uncompiled CPU flex (slow)"
    )
    parser.add_argument(
        "--batch-tokens", type=int, default=32768, help="rows per L: max(1, this // L)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    sizes = (4096, 8192) if args.quick else (4096, 8192, 16384, 32768, 65536)
    if args.quick:
        args.rounds, args.batch_tokens = 2, 8192
    rows = []
    for name, median, sigma, only in DOC_SETS:
        for length in (n for n in sizes if only is None or n in only):
            batch_rows = [  # row r drawn with seed L + r
                lognormal_lengths(length, median, sigma, seed=length + r)
                for r in range(max(1, args.batch_tokens // length))
            ]
            rows.append({"docs": name, **bench_case(length, batch_rows, args)})
            print(f"done {name} L={length}", flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        "H": H,
        "Hkv": HKV,
        "D": D,
        "B": f"max(1, {args.batch_tokens} // L)",
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "lengths": "lognormal(median, sigma) per doc set, row r of length L drawn with seed "
        "L + r, its last document cut to fill L",
        "rounds": args.rounds,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "load_average_at_end": os.getloadavg(),
    }
    args.out.write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
