"""Whole training step (forward + backward + AdamW) of the tiny-shaped Llama on packed rows.

longctx (sdpa backend, document masking, reset positions) at L = 4k .. 128k, against
transformers' LlamaForCausalLM with the same weights on the same documents, packed the way
its docs recommend (one row, reset position_ids, attention_mask=None, use_cache=False,
attn_implementation="sdpa"), and run document by document. Every (implementation, L) runs in
a fresh subprocess so ru_maxrss is that run's peak RSS. Every run keeps freed memory for reuse
(longctx.cpu_memory, as train.py does on CPU); one extra longctx row at 16k runs with glibc's
default malloc to show what that setting is worth.

    .venv/bin/python benchmarks/bench_step.py           # full table -> results/step.json
    .venv/bin/python benchmarks/bench_step.py --quick   # 4k only -> results/step_quick.json
    .venv/bin/python benchmarks/bench_step.py --repeat 2 --only longctx:16384,hf_packed:16384
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.cpu_memory import retain_freed_memory
from longctx.model import Llama, LlamaConfig, estimate_flops
from longctx.model.hf import config_to_hf, to_hf_name

RESULTS = Path(__file__).parent / "results"
RETAIN, DEFAULT = "retain", "default"  # malloc: freed memory kept for reuse, or glibc's default
FULL_RUNS = [("longctx", n, RETAIN) for n in (4096, 16384, 65536, 131072)] + [
    ("longctx", 16384, DEFAULT),
    ("hf_packed", 4096, RETAIN),
    ("hf_packed", 16384, RETAIN),
    ("hf_per_doc", 4096, RETAIN),
]
QUICK_RUNS = [("longctx", 4096, RETAIN), ("hf_packed", 4096, RETAIN)]
HF_PACKED_MAX_LEN = 16384  # above this its dense [L, L] mask would not fit: reported n/a


# --------------------------------------------------------------------------- workload
def make_batch(length: int, seed: int = 0, median: float = 600.0, sigma: float = 1.0):
    """One row of lognormal-length documents (median ``median``), the last one cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < length:
        n = int(math.exp(math.log(median) + sigma * torch.randn(1, generator=g).item()))
        n = max(2, min(n, length - total))
        lens.append(n)
        total += n
    tokens = torch.randint(0, 512, (1, length), generator=g)
    return PackedBatch.from_lengths(tokens, [lens], reset_position_ids=True)


def make_longctx(activation_checkpointing: bool) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig.from_name(
        "tiny", attn_backend="sdpa", activation_checkpointing=activation_checkpointing
    )
    return Llama(config)


def make_hf():
    """transformers' LlamaForCausalLM holding exactly make_longctx()'s weights."""
    import transformers

    ours = make_longctx(False)
    config = transformers.LlamaConfig(**config_to_hf(ours.config, torch.float32))
    config._attn_implementation = "sdpa"
    theirs = transformers.LlamaForCausalLM(config)
    theirs.load_state_dict({to_hf_name(k): v for k, v in ours.state_dict().items()})
    return theirs


# --------------------------------------------------------------------------- one step each
def longctx_step(model, batch: PackedBatch) -> float:
    loss_sum, count = model.loss(batch)
    (loss_sum / count).backward()
    return (loss_sum / count).item()


def hf_packed_step(model, batch: PackedBatch) -> float:
    logits = model(
        input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
        use_cache=False,
    ).logits  # fmt: skip
    loss = _ce_sum(logits, batch.labels) / batch.num_loss_tokens
    loss.backward()
    return loss.item()


def hf_per_doc_step(model, batch: PackedBatch) -> float:
    total, start = 0.0, 0
    for n in batch.seq_lens[0].tolist():
        sl = slice(start, start + n)
        logits = model(input_ids=batch.tokens[:, sl], use_cache=False).logits
        loss = _ce_sum(logits, batch.labels[:, sl]) / batch.num_loss_tokens
        loss.backward()  # gradient accumulation over documents
        total += loss.item()
        start += n
    return total


def _ce_sum(logits, labels):
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


STEPS = {"longctx": longctx_step, "hf_packed": hf_packed_step, "hf_per_doc": hf_per_doc_step}


def run_child(impl: str, length: int, malloc: str, min_steps: int, min_seconds: float, ckpt: bool):
    torch.set_num_threads(2)
    if malloc == RETAIN:
        retain_freed_memory()
    batch = make_batch(length)
    model = make_longctx(ckpt).train() if impl == "longctx" else make_hf().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = STEPS[impl]
    times, losses = [], []
    while len(times) < min_steps + 1 or sum(times[1:]) < min_seconds:
        start = time.perf_counter()
        losses.append(step(model, batch))
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        if len(times) > 20:
            break
    step_s = sum(times[1:]) / len(times[1:])  # the first step is warm-up
    flops = estimate_flops(model_config(), batch.seq_lens)
    lens = batch.seq_lens.flatten().double()
    return dict(
        impl=impl, L=length, malloc=malloc, docs=batch.num_segments, max_doc=int(lens.max()),
        pair_fraction=float((lens**2).sum() / 2 / length**2), activation_checkpointing=ckpt,
        steps=len(times) - 1, step_s=step_s, tokens_per_s=length / step_s,
        gflops_per_s=flops / step_s / 1e9, first_loss=losses[0],
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )  # fmt: skip


def model_config() -> LlamaConfig:
    return LlamaConfig.from_name("tiny", attn_backend="sdpa")


# --------------------------------------------------------------------------- driver
def _run_spec(spec: str) -> tuple[str, int, str]:
    """ "impl:L" or "impl:L:malloc" -> (impl, L, malloc)."""
    impl, length, *malloc = spec.split(":")
    if impl not in STEPS or malloc not in ([], [RETAIN], [DEFAULT]):
        raise SystemExit(f"--only {spec!r}: expected impl:L[:malloc], impl in {sorted(STEPS)}")
    return impl, int(length), malloc[0] if malloc else RETAIN


def run_in_subprocess(impl: str, length: int, malloc: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, str(length), malloc]
    cmd += ["--min-steps", str(args.min_steps), "--min-seconds", str(args.min_seconds)]
    if length >= args.ckpt_from:
        cmd.append("--ckpt")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return dict(impl=impl, L=length, malloc=malloc, error=proc.stderr.strip().splitlines()[-1:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fastest(passes: list[dict]) -> dict:
    """The pass with the shortest mean step (the shared machine only ever slows a run down),
    with every pass's step time kept alongside."""
    ok = [r for r in passes if "error" not in r]
    if not ok:
        return passes[-1]
    return {**min(ok, key=lambda r: r["step_s"]), "step_s_passes": [r["step_s"] for r in ok]}


def summarise(rows: list[dict]) -> dict:
    tps = {(r["impl"], r["L"]): r.get("tokens_per_s") for r in rows if r["malloc"] == RETAIN}
    ratios = {}
    for n in (4096, 16384):
        if tps.get(("longctx", n)) and tps.get(("hf_packed", n)):
            ratios[f"longctx_over_hf_packed_{n}"] = tps[("longctx", n)] / tps[("hf_packed", n)]
    if tps.get(("longctx", 4096)) and tps.get(("longctx", 131072)):
        ratios["longctx_4k_over_128k"] = tps[("longctx", 4096)] / tps[("longctx", 131072)]
    if tps.get(("longctx", 4096)) and tps.get(("hf_per_doc", 4096)):
        ratios["longctx_over_hf_per_doc_4096"] = tps[("longctx", 4096)] / tps[("hf_per_doc", 4096)]
    default = [r for r in rows if r["malloc"] == DEFAULT and r.get("tokens_per_s")]
    for r in default:
        if tps.get((r["impl"], r["L"])):
            name = f"{r['impl']}_{r['L']}_retain_over_default_malloc"
            ratios[name] = tps[(r["impl"], r["L"])] / r["tokens_per_s"]
    return ratios


def print_table(rows: list[dict], lengths: list[int]) -> None:
    head = (
        f"{'impl':<11} {'L':>7} {'malloc':>7} {'docs':>5} {'pairs/L2':>8} {'ckpt':>5} "
        f"{'step s':>8} {'tok/s':>8} "
    )
    print(head + f"{'GFLOP/s':>8} {'RSS GB':>7} {'loss0':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<11} {r['L']:>7} {r['malloc']:>7}  error: {r['error']}")
            continue
        print(
            f"{r['impl']:<11} {r['L']:>7} {r['malloc']:>7} {r['docs']:>5} "
            f"{r['pair_fraction']:>8.4f} "
            f"{str(r['activation_checkpointing']):>5} "
            f"{r['step_s']:>8.2f} {r['tokens_per_s']:>8.0f} {r['gflops_per_s']:>8.1f} "
            f"{r['peak_rss_gb']:>7.2f} {r['first_loss']:>8.5f}"
        )
    for n in lengths:
        if n > HF_PACKED_MAX_LEN:
            print(f"{'hf_packed':<11} {n:>7}  n/a (dense [L, L] mask would not fit)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4k only, one measured step")
    p.add_argument(
        "--only", default=None,
        help="comma list of impl:L[:malloc] to run, e.g. longctx:4096,longctx:4096:default",
    )  # fmt: skip
    p.add_argument("--ckpt-from", type=int, default=1 << 40, help="checkpoint layers from this L")
    p.add_argument("--min-steps", type=int, default=2)
    p.add_argument("--min-seconds", type=float, default=10.0)
    p.add_argument("--repeat", type=int, default=1, help="passes over all runs; fastest kept")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default results/step.json)")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "L", "MALLOC"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        impl, length, malloc = args.child[0], int(args.child[1]), args.child[2]
        row = run_child(impl, length, malloc, args.min_steps, args.min_seconds, args.ckpt)
        print(json.dumps(row))
        return
    runs = QUICK_RUNS if args.quick else FULL_RUNS
    if args.only:
        runs = [_run_spec(s) for s in args.only.split(",")]
    if args.quick:
        args.min_steps, args.min_seconds = 1, 0.0
    results: dict[tuple[str, int, str], list[dict]] = {run: [] for run in runs}
    for rep in range(args.repeat):  # interleaved passes: each run sees the machine's moods
        for run in runs:
            results[run].append(run_in_subprocess(*run, args))
            print(f"done {run} pass {rep}", file=sys.stderr, flush=True)
    rows = [_fastest(passes) for passes in results.values()]
    print_table(rows, sorted({n for i, n, _ in runs if i == "longctx"}))
    ratios = summarise(rows)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.out or RESULTS / ("step_quick.json" if args.quick else "step.json")
    meta = dict(
        threads=2, torch=torch.__version__, backend="sdpa", reset_position_ids=True,
        lengths="one row per L, lognormal median 600 sigma 1.0 (seed 0), last document cut",
        malloc="retain: longctx.cpu_memory.retain_freed_memory(); default: glibc's own",
        load_average_at_end=os.getloadavg(),
    )  # fmt: skip
    out.write_text(json.dumps(dict(meta=meta, rows=rows, ratios=ratios), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
