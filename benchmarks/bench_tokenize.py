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
  and ``encode_batch`` (on the first 200 chapters: it is slow);
- ``prepare --tokenizer llama3`` end to end (read the JSONL, tokenize, write the shards) on the
  corpus once and four times over: the difference is its rate past the fixed costs.

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


def best_times(rows: dict, repeats: int) -> dict[str, float]:
    """The fastest of ``repeats`` runs of each row (seconds), the rows taking turns so that a
    burst of other work on the machine disturbs every row alike."""
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(repeats):
        for name, fn in rows.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _corpus_jsonl(folder: Path, copies: int) -> Path:
    """The embedded corpus's training chapters as prepare reads them, ``copies`` times over
    (each copy's ids distinct)."""
    from longctx.data.corpus import _is_held_out, chapters, kjv_source_path

    records = [r for r in chapters(kjv_source_path()) if not _is_held_out(r)]
    path = folder / f"kjv-{copies}.jsonl"
    lines = (json.dumps({"id": f"{r['id']}#{k}", "text": r["text"]}, ensure_ascii=False)
             for k in range(copies) for r in records)  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def main(repeats: int = 3) -> None:
    from llama_models.llama3.tokenizer import Tokenizer

    from longctx.data.corpus import chapters, kjv_source_path
    from longctx.data.prepare import prepare
    from longctx.data.tokenizer import Llama3Tokenizer

    texts = [r["text"] for r in chapters(kjv_source_path())]
    ours = Llama3Tokenizer()
    reference = Tokenizer(ours.model_file)
    enc, fast = reference.model, ours.fast_tokenizer()
    tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
    few = texts[:200]  # the slow rows read the first 200 chapters
    few_tokens = sum(len(enc.encode_ordinary(t)) for t in few)
    rows = {
        "tiktoken encode_ordinary (anchor)": lambda: [enc.encode_ordinary(t) for t in texts],
        "tiktoken encode_ordinary_batch": lambda: enc.encode_ordinary_batch(texts, num_threads=1),
        "reference Tokenizer.encode": lambda: [
            reference.encode(t, bos=False, eos=False) for t in texts
        ],
        "longctx Llama3Tokenizer.encode": lambda: [ours.encode(t) for t in texts],
        "HF fast tokenizer encode": lambda: [fast.encode(t, add_special_tokens=False) for t in few],
        "HF fast tokenizer encode_batch": lambda: fast.encode_batch(few, add_special_tokens=False),
    }
    with tempfile.TemporaryDirectory() as tmp:
        copies = {1: _corpus_jsonl(Path(tmp), 1), 4: _corpus_jsonl(Path(tmp), 4)}
        prepared: dict[int, int] = {}
        runs = iter(range(1000))

        def run_prepare(n: int) -> None:  # a new folder each time (else a no-op)
            manifest = prepare([copies[n]], Path(tmp) / f"out{next(runs)}", "llama3", tasks=1,
                               workers=1, val_fraction=0.05, progress=False)  # fmt: skip
            splits = manifest.splits.values()
            prepared[n] = sum(s.tokens - s.documents for s in splits)  # without the EOS

        rows["prepare, the corpus once"] = lambda: run_prepare(1)
        rows["prepare, the corpus 4 times"] = lambda: run_prepare(4)
        seconds = best_times(rows, repeats)
    # prepare's rate past its fixed costs (loading the ranks twice, datatrove, the manifest)
    marginal = (prepared[4] - prepared[1]) / (
        seconds["prepare, the corpus 4 times"] - seconds["prepare, the corpus once"]
    )
    anchor = tokens / seconds["tiktoken encode_ordinary (anchor)"]
    table = []
    for name, s in seconds.items():
        count = prepared[4 if "4 times" in name else 1] if name.startswith("prepare") else tokens
        count = few_tokens if name.startswith("HF") else count
        table.append({"what": name, "seconds": s, "tokens": count, "tokens_per_s": count / s,
                      "anchor_over_this": anchor * s / count})  # fmt: skip
    table.append({"what": "prepare, marginal (4 times - once)", "tokens_per_s": marginal,
                  "anchor_over_this": anchor / marginal})  # fmt: skip
    result = {
        "what": __doc__.splitlines()[0],
        "text": f"{len(texts)} chapters, {sum(map(len, texts)):,} characters",
        "repeats": repeats,
        "prepared_tokens": prepared,
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
