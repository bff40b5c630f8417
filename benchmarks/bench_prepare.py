"""prepare throughput (tokens/s): the datatrove pipeline (local executor, 1 and 2 tasks)
against the process-pool prepare it replaced, with the byte tokenizer and a local BPE.

    .venv/bin/python benchmarks/bench_prepare.py [--repeat 2] [--byte-copies 4]

The baseline is prepare.py as of BASELINE_REV, loaded from git history into its own module,
so both run side by side in one process on the same input (the machine is shared and its speed
drifts: the variants alternate, and each cell is the best of --repeat runs). The corpus is the
embedded King James chapters (4.4 MB) in one JSONL, written --byte-copies times for the byte
tokenizer (fast enough that fixed start-up costs would otherwise dominate) and once for a BPE
of 4,096 ids trained on it here. Prints a table and writes benchmarks/results/prepare.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longctx.data.corpus import chapters, kjv_source_path
from longctx.data.prepare import prepare
from longctx.data.shards import load_manifest
from longctx.io import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prepare.json"
BASELINE_REV = "2dc68dd"  # main before prepare became a datatrove pipeline


def load_baseline():
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{BASELINE_REV}:longctx/data/prepare.py"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # names that moved since (longctx.io took the temp-file helpers): the old module imports
    # them from where they were
    import longctx.data.shards as shards
    import longctx.io

    shards.remove_temp_files = getattr(shards, "remove_temp_files", longctx.io.remove_temp_files)
    spec = importlib.util.spec_from_loader("prepare_baseline", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its worker pool pickles functions by module name
    exec(compile(source, f"{BASELINE_REV}:longctx/data/prepare.py", "exec"), module.__dict__)
    return module


def write_corpus(folder: Path, copies: int) -> Path:
    records = list(chapters(kjv_source_path()))
    folder.mkdir(parents=True)
    path = folder / "kjv.jsonl"
    with open(path, "w") as f:
        for copy in range(copies):
            for r in records:
                f.write(json.dumps({"id": f"{copy}/{r['id']}", "text": r["text"]}) + "\n")
    return path


def train_bpe(corpus: Path, folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["[UNK]", "</s>"])
    texts = (json.loads(line)["text"] for line in corpus.open())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def run_once(variant: str, workers: int, corpus: Path, tokenizer: str, baseline, tmp: Path):
    out = tmp / f"{variant}-{workers}-{time.monotonic_ns()}"
    start = time.perf_counter()
    if variant == "pool (before)":
        baseline.prepare([corpus], out, tokenizer, workers=workers, progress=False)
    else:
        prepare([corpus], out, tokenizer, tasks=workers, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    m = load_manifest(out)
    return seconds, m.splits["train"].tokens + m.splits["val"].tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--byte-copies", type=int, default=4)
    args = parser.parse_args()
    baseline = load_baseline()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        corpora = {"byte": write_corpus(tmp / "byte", args.byte_copies)}
        corpora["bpe-4096"] = write_corpus(tmp / "bpe", 1)
        bpe = train_bpe(corpora["bpe-4096"], tmp / "bpe" / "tokenizer")
        tokenizers = {"byte": "byte", "bpe-4096": str(bpe)}
        cells = [
            (tok, variant, workers)
            for tok in tokenizers
            for workers in (1, 2)
            for variant in ("pool (before)", "datatrove local")
        ]
        best: dict[tuple, tuple[float, int]] = {}
        for _ in range(args.repeat):  # alternate variants so drift hits all of them alike
            for tok, variant, workers in cells:
                corpus = corpora[tok]
                seconds, tokens = run_once(variant, workers, corpus, tokenizers[tok], baseline, tmp)
                key = (tok, variant, workers)
                best[key] = min(best.get(key, (seconds, tokens)), (seconds, tokens))
        for (tok, variant, workers), (seconds, tokens) in best.items():
            rows.append(
                {
                    "tokenizer": tok,
                    "variant": variant,
                    "processes": workers,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tokens_per_s": tokens / seconds,
                    "corpus_mb": corpora[tok].stat().st_size / 1e6,
                    "mb_per_s": corpora[tok].stat().st_size / 1e6 / seconds,
                }
            )
        meta = {
            "repeat": args.repeat,
            "baseline_rev": BASELINE_REV,
            "cpus": os.cpu_count(),
            "load_avg_1min_at_end": os.getloadavg()[0],
            "python": platform.python_version(),
        }
    print_table(rows)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS, json.dumps({"meta": meta, "rows": rows}, indent=2).encode())
    print(f"wrote {RESULTS}")


def print_table(rows: list[dict]) -> None:
    by_key = {(r["tokenizer"], r["variant"], r["processes"]): r for r in rows}
    print("| tokenizer | processes | pool (before) | datatrove local | datatrove / pool |")
    print("|---|---|---|---|---|")
    for tok in dict.fromkeys(r["tokenizer"] for r in rows):
        for p in (1, 2):
            before = by_key[(tok, "pool (before)", p)]["tokens_per_s"]
            after = by_key[(tok, "datatrove local", p)]["tokens_per_s"]
            print(
                f"| {tok} | {p} | {before:,.0f} tok/s | {after:,.0f} tok/s | {after / before:.2f} |"
            )


if __name__ == "__main__":
    main()
