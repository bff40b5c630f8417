"""Should longctx train with a BOS at each document start? lm-eval's number decides.

lm-eval's loglikelihood_rolling puts one token before every document: the tokenizer's BOS, or
its EOS when it has no BOS (a tokenizer cannot tell it to put none). longctx trains without a
BOS, so that token is one the model never saw as context. This trains the tiny model twice on
the embedded corpus, the same steps and seed:
  A. as longctx does (documents + EOS);
  B. with one BOS at each document start (BOS + document + EOS; the EOS -> BOS target is
     masked like any boundary), prepared through a tokenizer that prepends it;
exports both and scores the same held-out documents with lm-eval:
  A/bos  the export as written (lm-eval prefixes BOS 257, never trained);
  A/eos  lm-eval prefixing EOS 258 instead (an export whose tokenizer has no BOS);
  B/bos  the BOS-trained model with lm-eval's BOS prefix, the convention it was trained with;
beside longctx's own bits per byte on those documents. Prints a table, writes
benchmarks/results/export_bos.json.

    python benchmarks/bench_export_bos.py [--steps 300] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CACHE = ROOT / "data_cache"  # the embedded corpus, prepared once per checkout

from longctx.data.tokenizer import ByteTokenizer  # noqa: E402


class BosByteTokenizer(ByteTokenizer):
    """The byte tokenizer with BOS before every document: arm B's data."""

    def encode(self, text: str) -> np.ndarray:
        return np.concatenate([[self.BOS], super().encode(text)]).astype(np.int64)


def prepare_arms(work: Path) -> dict[str, Path]:
    from longctx.data.cache import cache_root
    from longctx.data.corpus import CORPUS_NAME, VAL_FRACTION, default_corpus_dir
    from longctx.data.prepare import prepare

    plain = default_corpus_dir(CACHE)
    jsonl = cache_root(CACHE) / f"{CORPUS_NAME}.jsonl"
    bos = work / "corpus_bos"
    prepare([jsonl], bos, BosByteTokenizer(), workers=1, val_fraction=VAL_FRACTION, progress=False)
    return {"A": plain, "B": bos}


def train(name: str, shards: Path, work: Path, steps: int, seed: int) -> Path:
    root = work / (f"run_{name}" if seed == 0 else f"run_{name}_s{seed}")
    if not list(root.glob("outputs/*/*/checkpoints/last.ckpt")):
        args = [
            "model=tiny",
            "data=shards",
            f"data.shards={shards}",
            "data.seq_len=512",
            "data.micro_batch_size=4",
            "data.num_workers=0",
            "data.val_rows=4",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            "logger=csv",
            "callbacks=default",
            f"paths.root_dir={root}",
            f"paths.cache_dir={CACHE}",
            f"seed={seed}",
        ]
        env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, str(ROOT / "train.py"), *args], check=True, env=env)
    (ckpt,) = root.glob("outputs/*/*/checkpoints/last.ckpt")
    return ckpt


def score(ckpt: Path, out: Path, documents: int, prefixes: dict[str, int | None]) -> dict:
    from longctx.hf.export import export
    from longctx.hf.verify import run_lm_eval, verify

    if not out.exists():
        export(ckpt, out)
    result = verify(out, documents)  # lm-eval with the export's own prefix: its BOS
    scores = {
        "longctx_own": result.bpb_longctx_own,
        "longctx_bos_prefix": result.bpb_longctx_rolling,
        "max_logit_diff": result.max_diff,
        "bos": result.bpb_lm_eval,
    }
    for label, prefix in prefixes.items():
        scores[label] = run_lm_eval(out, out / "lm_eval", prefix_token_id=prefix)
    return scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--documents", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="model init and data order of both arms")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "results" / "export_bos")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folders = prepare_arms(args.work)
    ckpts = {n: train(n, f, args.work, args.steps, args.seed) for n, f in folders.items()}
    eos, tag = ByteTokenizer.EOS, "" if args.seed == 0 else f"_s{args.seed}"
    results = {
        "A": score(ckpts["A"], args.work / f"hf_A{tag}", args.documents, {"eos": eos}),
        "B": score(ckpts["B"], args.work / f"hf_B{tag}", args.documents, {}),
    }
    print(
        f"\nbits per byte on {args.documents} held-out documents after {args.steps} steps, seed {args.seed}"
    )
    print(f"{'arm':<28}{'lm-eval':>10}{'longctx own':>13}")
    rows = [
        ("A no BOS, lm-eval BOS prefix", results["A"]["bos"], results["A"]["longctx_own"]),
        ("A no BOS, lm-eval EOS prefix", results["A"]["eos"], results["A"]["longctx_own"]),
        ("B add_bos, lm-eval BOS prefix", results["B"]["bos"], results["B"]["longctx_own"]),
    ]
    for label, lm, own in rows:
        print(f"{label:<28}{lm:>10.4f}{own:>13.4f}")
    path = ROOT / "benchmarks" / "results" / "export_bos.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    record = {k: v for k, v in record.items() if k.startswith("seed")}  # one entry per seed
    record[f"seed{args.seed}"] = {"steps": args.steps, "documents": args.documents, **results}
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
