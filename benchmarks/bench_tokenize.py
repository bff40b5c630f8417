"""Tokens/s per core of `prepare --tokenizer llama3` against tiktoken alone on the same text.

The text is the embedded corpus's training chapters (1,115 King James chapters, the held-out
books left out: 4.0 M characters, 984,469 Llama 3 tokens), one document per chapter, the same
text for every row (prepare reads it as JSONL). Every row runs on one core
(RAYON_NUM_THREADS=1 for the tokenizers library, one tiktoken thread, prepare with one task and
one worker):

- tiktoken alone (the anchor): ``Encoding.encode_ordinary`` per document on Llama 3's ranks and
  pattern, ``encode_ordinary_batch`` (num_threads=1), and ``encode_to_numpy`` (the same ids
  as a uint32 array, no Python list: what ``Llama3Tokenizer.encode`` calls);
- the reference, ``llama_models.llama3.tokenizer.Tokenizer.encode(s, bos=False, eos=False)``;
- longctx's ``Llama3Tokenizer.encode`` (what prepare calls per document);
- the Hugging Face fast tokenizer of the same vocabulary (what an export carries), per document
  and ``encode_batch`` (on the first 200 chapters: it is slow);
- ``prepare --tokenizer llama3`` end to end (read the JSONL, tokenize, write the shards) on the
  corpus once and four times over: the difference is its rate past the fixed costs.

Rates are tokens per CPU second of this process (the best of ``repeats`` runs, the rows taking
turns): on a machine shared with other work a row's wall time grows with what else runs, its CPU
time much less. Wall seconds are recorded beside them (prepare's fsyncs wait on the disk, which
CPU time does not count).

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


def best_times(rows: dict, repeats: int) -> dict[str, dict[str, float]]:
    """The least CPU time and the least wall time (seconds) of ``repeats`` runs of each row,
    the rows taking turns so that a burst of other work on the machine disturbs every row alike."""
    best = {name: {"cpu": float("inf"), "wall": float("inf")} for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            best[name]["cpu"] = min(best[name]["cpu"], time.process_time() - cpu)
            best[name]["wall"] = min(best[name]["wall"], time.perf_counter() - wall)
    return best


def _training_chapters() -> list[dict]:
    from longctx.data.corpus import _is_held_out, chapters, kjv_source_path

    return [r for r in chapters(kjv_source_path()) if not _is_held_out(r)]


def _corpus_jsonl(folder: Path, records: list[dict], copies: int) -> Path:
    """``records`` as prepare reads them, ``copies`` times over (each copy's ids distinct)."""
    path = folder / f"kjv-{copies}.jsonl"
    lines = (json.dumps({"id": f"{r['id']}#{k}", "text": r["text"]}, ensure_ascii=False)
             for k in range(copies) for r in records)  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def main(repeats: int = 5) -> None:
    import tiktoken
    from llama_models.llama3.tokenizer import Tokenizer

    from longctx.data.prepare import prepare
    from longctx.data.tokenizer import Llama3Tokenizer

    load_at_start = os.getloadavg()
    records = _training_chapters()
    texts = [r["text"] for r in records]
    ours = Llama3Tokenizer()
    reference = Tokenizer(ours.model_file)
    enc, fast = reference.model, ours.fast_tokenizer()
    tokens = sum(len(enc.encode_ordinary(t)) for t in texts)
    few = texts[:200]  # the slow rows read the first 200 chapters
    few_tokens = sum(len(enc.encode_ordinary(t)) for t in few)
    rows = {
        "tiktoken encode_ordinary (anchor)": lambda: [enc.encode_ordinary(t) for t in texts],
        "tiktoken encode_ordinary_batch": lambda: enc.encode_ordinary_batch(texts, num_threads=1),
        "tiktoken encode_to_numpy": lambda: [
            enc.encode_to_numpy(t, disallowed_special=()) for t in texts
        ],
        "reference Tokenizer.encode": lambda: [
            reference.encode(t, bos=False, eos=False) for t in texts
        ],
        "longctx Llama3Tokenizer.encode": lambda: [ours.encode(t) for t in texts],
        "HF fast tokenizer encode": lambda: [fast.encode(t, add_special_tokens=False) for t in few],
        "HF fast tokenizer encode_batch": lambda: fast.encode_batch(few, add_special_tokens=False),
    }
    with tempfile.TemporaryDirectory() as tmp:
        copies = {n: _corpus_jsonl(Path(tmp), records, n) for n in (1, 4)}
        prepared: dict[int, int] = {}
        runs = iter(range(1000))

        def run_prepare(n: int) -> None:  # a new folder each time (else a no-op)
            manifest = prepare([copies[n]], Path(tmp) / f"out{next(runs)}", "llama3", tasks=1,
                               workers=1, val_fraction=0.05, progress=False)  # fmt: skip
            splits = manifest.splits.values()
            prepared[n] = sum(s.tokens - s.documents for s in splits)  # without the EOS

        once, four = "prepare, the corpus once", "prepare, the corpus 4 times"
        rows[once], rows[four] = lambda: run_prepare(1), lambda: run_prepare(4)
        seconds = best_times(rows, repeats)
    assert prepared[1] == tokens, (prepared, tokens)  # the same text, the same ids
    # prepare's rate past its fixed costs (hashing the input, datatrove's executor and task logger,
    # fsyncs, the manifest; the ranks were loaded above and prepare reuses them in this process)
    marginal = "prepare, marginal (4 times - once)"
    seconds[marginal] = {c: seconds[four][c] - seconds[once][c] for c in seconds[four]}
    counts = {once: prepared[1], four: prepared[4], marginal: prepared[4] - prepared[1]}
    anchor = seconds["tiktoken encode_ordinary (anchor)"]
    table = []
    for name, s in seconds.items():
        count = counts.get(name, few_tokens if name.startswith("HF") else tokens)
        rates = {c: count / s[c] for c in s}
        table.append({"what": name, "tokens": count, "cpu_seconds": s["cpu"],
                      "wall_seconds": s["wall"], "tokens_per_cpu_s": rates["cpu"],
                      "tokens_per_wall_s": rates["wall"],
                      "anchor_over_this": tokens / anchor["cpu"] / rates["cpu"],
                      "anchor_over_this_wall": tokens / anchor["wall"] / rates["wall"]})  # fmt: skip
    result = {
        "what": __doc__.splitlines()[0],
        "text": f"{len(texts)} chapters, {sum(map(len, texts)):,} characters",
        "repeats": repeats,
        "prepared_tokens": prepared,
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
        "python": sys.version.split()[0],
        "tiktoken": tiktoken.__version__,
        "rows": table,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| what | tokens/s, one core (CPU time) | anchor / this | wall: anchor / this |")
    print("|---|---:|---:|---:|")
    for r in table:
        print(f"| {r['what']} | {r['tokens_per_cpu_s']:,.0f} | {r['anchor_over_this']:.2f}x "
              f"| {r['anchor_over_this_wall']:.2f}x |")  # fmt: skip
    print(f"load average {load_at_start} at the start, {os.getloadavg()} at the end")


if __name__ == "__main__":
    main()
