"""GPU benchmark: attention backends and a 2-layer Llama-3-8B-shape training step, bf16.

Run by scripts/gpu_check.sh on a CUDA machine. For L in (8192, 32768), one row of documents with
lognormal lengths (median 600, sigma 1, the CPU benchmark's distribution), B=1:

- attention fwd+bwd at the Llama 3 8B shape (H=32, Hkv=8, D=128) for every CUDA backend this
  machine can run (flash via flash-attn and/or torch varlen, flex, sdpa at a few padding
  budgets, and a dense-mask SDPA baseline at 8k): ms, tokens/s, and TFLOP/s counting only the
  in-document causal work (4*H*D FLOPs per query-key pair forward, x3.5 for fwd+bwd, the
  FlashAttention convention);
- a training step (fwd+bwd, no optimizer) of Llama(LlamaConfig.from_name("llama3_8b",
  n_layers=2)) in bf16 for each backend: tokens/s and MFU against an H200 bf16 dense peak of
  989 TFLOP/s, FLOPs from longctx.model.estimate_flops.

--cpu-smoke runs the same code paths tiny on CPU (sdpa, fp32) so the script's logic is checked
without a GPU. Results go to $OUT/gpu_bench.json (else benchmarks/results/gpu/); the table is
printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx.batch import PackedBatch
from longctx.model.attention import AttentionMetadata, attention, build_attention_metadata
from longctx.model.attention.flash import available_flash_impls
from longctx.model.attention.sdpa import build_sdpa_plan

H200_BF16_PEAK_FLOPS = 989e12


@dataclasses.dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    lengths: tuple[int, ...]
    heads: tuple[int, int, int]  # H, Hkv, D
    model_overrides: dict
    iters: int
    peak_flops: float | None
    doc_median: float = 600  # lognormal document length median (sigma 1)


GPU = Setup(
    torch.device("cuda"),
    torch.bfloat16,
    (8192, 32768),
    (32, 8, 128),
    {"n_layers": 2},
    10,
    H200_BF16_PEAK_FLOPS,
)
CPU_SMOKE = Setup(
    torch.device("cpu"),
    torch.float32,
    (256, 512),
    (4, 2, 16),
    {"n_layers": 2, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512},
    1,
    None,
    doc_median=60,  # several documents per row even at L=256
)


# ----------------------------------------------------------------------------- inputs
def lognormal_lengths(length: int, median: float = 600, sigma: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < length:
        draw = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=gen)))
        lengths.append(max(1, min(round(draw), length - sum(lengths))))
    return lengths


def make_batch(length: int, setup: Setup, vocab: int = 1000) -> PackedBatch:
    lengths = lognormal_lengths(length, median=setup.doc_median, seed=length)
    tokens = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return PackedBatch.from_lengths(tokens, [lengths], reset_position_ids=True).to(setup.device)


def in_document_pairs(batch: PackedBatch) -> float:
    return float((batch.seq_lens.double() ** 2).sum()) / 2


# ----------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_it(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Mean seconds per call after warm-up (warm-up includes any compilation)."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


# ----------------------------------------------------------------------------- attention
def attention_variants(batch: PackedBatch, setup: Setup) -> dict[str, AttentionMetadata]:
    """Every way to run document attention on this device, by name."""
    variants: dict[str, AttentionMetadata] = {}
    for impl in available_flash_impls(setup.device):
        meta = build_attention_metadata(batch, "flash")
        variants[f"flash/{impl}"] = dataclasses.replace(
            meta, data=dataclasses.replace(meta.data, impl=impl)
        )
    if setup.device.type == "cuda":
        variants["flex"] = build_attention_metadata(batch, "flex")
    sdpa = build_attention_metadata(batch, "sdpa")
    variants["sdpa"] = sdpa
    for budget in (32**2, 128**2, 1024**2):
        plan = build_sdpa_plan(batch, pad_budget=budget)
        variants[f"sdpa/pad{int(math.sqrt(budget))}^2"] = dataclasses.replace(
            sdpa, data=dataclasses.replace(sdpa.data, plan=plan)
        )
    return variants


def bench_attention(length: int, setup: Setup) -> list[dict]:
    batch = make_batch(length, setup)
    h, hkv, d = setup.heads
    gen = torch.Generator(device=setup.device).manual_seed(0)

    def rand(n):
        x = torch.randn(1, length, n, d, generator=gen, device=setup.device, dtype=setup.dtype)
        return x.requires_grad_(True)

    q, k, v = rand(h), rand(hkv), rand(hkv)
    grad_out = torch.randn_like(q)
    flops = 3.5 * 4 * h * d * in_document_pairs(batch)
    rows = []
    for name, meta in attention_variants(batch, setup).items():
        rows.append(
            _time_attention(
                name, length, lambda m=meta: _fwd_bwd(q, k, v, grad_out, m), flops, batch, setup
            )
        )
    if length <= 8192:
        mask = batch.to_dense_mask().unsqueeze(1)
        rows.append(
            _time_attention(
                "dense-mask sdpa",
                length,
                lambda: _dense_fwd_bwd(q, k, v, grad_out, mask),
                flops,
                batch,
                setup,
            )
        )
    return rows


def _fwd_bwd(q, k, v, grad_out, meta):
    attention(q, k, v, meta).backward(grad_out)


def _dense_fwd_bwd(q, k, v, grad_out, mask_B1LL):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask_B1LL,
        enable_gqa=True,
    )
    out.backward(grad_out.transpose(1, 2))


def _time_attention(name, length, fn, flops, batch, setup) -> dict:
    row = {"bench": "attention", "variant": name, "L": length, "n_docs": batch.num_segments}
    try:
        seconds = time_it(fn, setup.device, setup.iters)
    except Exception as err:  # one failing backend must not hide the others' numbers
        traceback.print_exc()
        return {**row, "error": f"{type(err).__name__}: {str(err)[:200]}"}
    return {
        **row,
        "ms": seconds * 1e3,
        "tokens_per_s": length / seconds,
        "tflops": flops / seconds / 1e12,
    }


# ----------------------------------------------------------------------------- model step
def bench_model(length: int, setup: Setup) -> list[dict]:
    try:
        from longctx.model import Llama, LlamaConfig, estimate_flops
    except ImportError as err:
        print(f"model step skipped: longctx.model is not importable ({err})")
        return [{"bench": "train_step", "L": length, "error": f"import failed: {err}"}]
    backends = [b for b in ("flash", "flex", "sdpa") if _model_backend_runs(b, setup)]
    rows = []
    for backend in backends:
        config = LlamaConfig.from_name("llama3_8b", attn_backend=backend, **setup.model_overrides)
        batch = make_batch(length, setup, vocab=config.vocab_size)
        rows.append(_time_model(backend, config, batch, setup, Llama, estimate_flops))
    return rows


def _model_backend_runs(backend: str, setup: Setup) -> bool:
    if backend == "flash":
        return bool(available_flash_impls(setup.device))
    return backend == "sdpa" or setup.device.type == "cuda"


def _time_model(backend, config, batch, setup, llama_cls, estimate_flops) -> dict:
    length = batch.shape[1]
    row = {"bench": "train_step", "variant": backend, "L": length, "n_docs": batch.num_segments}
    try:
        with torch.device(setup.device):
            model = llama_cls(config).to(setup.dtype)

        def step():
            loss_sum, n_tokens = model.loss(batch)
            (loss_sum / n_tokens).backward()
            model.zero_grad(set_to_none=True)

        seconds = time_it(step, setup.device, max(1, setup.iters // 2))
    except Exception as err:
        traceback.print_exc()
        return {**row, "error": f"{type(err).__name__}: {str(err)[:200]}"}
    finally:
        model = None
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    flops = estimate_flops(config, batch.seq_lens.cpu())
    mfu = flops / seconds / setup.peak_flops if setup.peak_flops else None
    return {
        **row,
        "ms": seconds * 1e3,
        "tokens_per_s": length / seconds,
        "tflops": flops / seconds / 1e12,
        "mfu": mfu,
    }


# ----------------------------------------------------------------------------- report
def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'bench':<11} {'variant':<20} {'L':>6} {'docs':>5} {'ms':>9} {'tok/s':>11} "
        f"{'TFLOP/s':>8} {'MFU':>6}"
    )
    for r in rows:
        head = f"{r['bench']:<11} {r.get('variant', '-'):<20} {r['L']:>6} {r.get('n_docs', 0):>5}"
        if "error" in r:
            print(f"{head} ERROR {r['error']}")
            continue
        mfu = f"{r['mfu'] * 100:5.1f}%" if r.get("mfu") is not None else "   n/a"
        print(f"{head} {r['ms']:9.2f} {r['tokens_per_s']:11.0f} {r['tflops']:8.1f} {mfu}")


def environment() -> dict:
    env = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "flash_impls": list(available_flash_impls(torch.device("cuda")))
        if torch.cuda.is_available()
        else [],
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def results_dir() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else Path(__file__).parent / "results" / "gpu"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="GPU attention + training-step benchmark")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on CPU, sdpa, fp32")
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print(
            "gpu_bench: no CUDA device here (torch.cuda.is_available() is False); "
            "use --cpu-smoke to check the script's code paths on CPU"
        )
        return 2
    setup = CPU_SMOKE if args.cpu_smoke else GPU
    print(json.dumps(environment()), flush=True)
    out = results_dir() / ("gpu_bench_cpu_smoke.json" if args.cpu_smoke else "gpu_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    stages = [(bench_attention, length) for length in setup.lengths]
    if not args.skip_model:
        stages += [(bench_model, length) for length in setup.lengths]
    try:
        for stage, length in stages:  # attention first: it is the cheaper, more vital half
            rows += stage(length, setup)
            out.write_text(json.dumps({"env": environment(), "rows": rows}, indent=1))
            print(f"{stage.__name__} L={length} done; wrote {out}", flush=True)
    except KeyboardInterrupt:  # gpu_check.sh's timeout sends SIGINT: report what finished
        print("interrupted: the table below holds the stages that finished")
        rows.append({"bench": "interrupted", "L": 0, "error": "time limit reached"})
    print_table(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
