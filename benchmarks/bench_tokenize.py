"""Tokens/s per core of `prepare --tokenizer llama3` against tiktoken alone on the same text.

The text is the embedded corpus (1,189 King James chapters, 4.2 M characters, about a million
Llama 3 tokens), one document per chapter as prepare reads it. Every row runs on one core
(RAYON_NUM_THREADS=1 for the tokenizers library, one tiktoken thread, prepare with one task and
one worker):

- tiktoken alone (the anchor): ``Encoding.encode_ordinary`` per document on Llama 3's ranks and
  pattern, and ``encode_ordinary_batch`` (num_threads=1);
- the reference, ``llama_models.llama3.tokenizer.Tokenizer.encode(s, bos=False, eos=False)``;
- longctx's ``Llama3Tokenizer.encode`` (what prepare calls per document);
- the Hugging Face fast tokenizer of the same vocabulary (what an export carries), per document
  and ``encode_batch``;
- ``prepare --tokenizer llama3`` end to end: read the JSONL, tokenize, write the shards.

    .venv/bin/python benchmarks/bench_tokenize.py   # -> benchmarks/results/tokenize.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers is imported: one core
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tokenize.json"


def best_of(repeats: int, fn) -> float:
    """The fastest of ``repeats`` runs (seconds): the least disturbed by other work."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(repeats: int = 3) -> None:
    from llama_models.llama3.tokenizer import Tokenizer

    from longctx.data.corpus import _is_held_out, chapters, kjv_source_path
    from longctx.data.prepare import prepare
    from longctx.data.tokenizer import Llama3Tokenizer

    texts = [r["text"] for r in chapters(kjv_source_path())]
    ours = Llama3Tokenizer()
    reference = Tokenizer(ours.model_file)
    enc, fast = reference.model, ours.fast_tokenizer()
    tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
    rows = {
        "tiktoken encode_ordinary (anchor)": lambda: [enc.encode_ordinary(t) for t in texts],
        "tiktoken encode_ordinary_batch": lambda: enc.encode_ordinary_batch(texts, num_threads=1),
        "reference Tokenizer.encode": lambda: [
            reference.encode(t, bos=False, eos=False) for t in texts
        ],
        "longctx Llama3Tokenizer.encode": lambda: [ours.encode(t) for t in texts],
        "HF fast tokenizer encode": lambda: [
            fast.encode(t, add_special_tokens=False) for t in texts
        ],
        "HF fast tokenizer encode_batch": lambda: fast.encode_batch(
            texts, add_special_tokens=False
        ),
    }
    seconds = {name: best_of(repeats, fn) for name, fn in rows.items()}
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "kjv.jsonl"
        records = (r for r in chapters(kjv_source_path()) if not _is_held_out(r))
        jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        prepared_tokens, runs = None, iter(range(repeats))

        def run_prepare():  # a new folder each time (a second run into one would be a no-op)
            nonlocal prepared_tokens
            manifest = prepare([jsonl], Path(tmp) / f"out{next(runs)}", "llama3", tasks=1,
                               workers=1, val_fraction=0.05, progress=False)  # fmt: skip
            splits = manifest.splits.values()
            prepared_tokens = sum(s.tokens - s.documents for s in splits)  # without the EOS

        name = "prepare --tokenizer llama3 (1 task, 1 worker)"
        seconds[name] = best_of(repeats, run_prepare)
    anchor = tokens / seconds["tiktoken encode_ordinary (anchor)"]
    table = []
    for name, s in seconds.items():
        count = prepared_tokens if name.startswith("prepare") else tokens
        rate = count / s
        table.append({"what": name, "seconds": s, "tokens": count, "tokens_per_s": rate,
                      "anchor_over_this": anchor / rate})  # fmt: skip
    result = {
        "what": __doc__.splitlines()[0],
        "text": f"{len(texts)} chapters, {sum(map(len, texts)):,} characters",
        "repeats": repeats,
        "load_average_at_end": os.getloadavg(),
        "python": sys.version.split()[0],
        "rows": table,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| what | tokens/s (one core) | anchor / this |\n|---|---:|---:|")
    for row in table:
        print(f"| {row['what']} | {row['tokens_per_s']:,.0f} | {row['anchor_over_this']:.2f}x |")


if __name__ == "__main__":
    main()
