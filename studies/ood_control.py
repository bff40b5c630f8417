"""Score a run on held-out documents of the out-of-distribution formats it trained on
(longctx.synthetic.ood): does the evidence's control retrieve in its own formats at all?

    python -m studies.ood_control RUN [RUN ...] --out DIR [--documents 256] [--length L]

The documents are the held-out answer loss's (:func:`longctx.eval.answer_loss.answer_documents`:
their own stream, the haystack the run's held-out chapters), at the run's row length unless
``--length``. Each answer (a run of answer tokens: a ledger code, a locker number, a relay's
stored value, an echoed span) is scored twice: teacher-forced (its tokens' loss and argmax) and
by greedy generation from the document up to it (the suite's path, prefill then the KV cache).
The answer is exact when every token is right; the two paths must agree on that, and on the first
token. ``other_value``: the generation is another answer of the same document (a value
retrieved, the wrong one). Chance of an exact answer is below 1e-6 in every format.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from longctx.batch import IGNORE_INDEX
from longctx.cli import command
from longctx.data import LongCtxDataModule
from longctx.data.arms import arm_label
from longctx.errors import LongctxError
from longctx.eval.answer_loss import answer_batches, answer_documents, held_out_text
from longctx.eval.cli import load_model
from longctx.eval.files import write_json, write_rows
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.model.generate import greedy_generate
from longctx.runs.record import read_stored_run
from longctx.synthetic.tasks import names_of

TASKS = names_of("ood")


def answer_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every run of answer tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@torch.no_grad()
def score_document(model, tokens: np.ndarray, mask: np.ndarray) -> list[dict]:
    """One record per answer: its tokens, loss sum, right tokens, exact (teacher-forced),
    generated exact, other_value."""
    # one row of exactly the document, its labels the answer tokens only
    ((batch, _),) = answer_batches([("", tokens, mask)], len(tokens), 1, pad_id=0)
    logits = model.labelled_logits(batch.to(model.output_weight.device)).float().cpu()
    targets = batch.labels[batch.labels != IGNORE_INDEX]
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    right = logits.argmax(-1) == targets
    spans = answer_spans(mask)
    values = [tokens[s:e].tolist() for s, e in spans]
    out, i = [], 0
    for k, (s, e) in enumerate(spans):
        n = e - s
        gen = greedy_generate(model, tokens[:s], max_new_tokens=n)
        exact = bool(right[i : i + n].all())
        if exact != (gen == values[k]) or (gen[0] == values[k][0]) != bool(right[i]):
            raise RuntimeError(
                f"answer {k} at {s}: generation gave {gen}, teacher forcing "
                f"{logits[i : i + n].argmax(-1).tolist()} for {values[k]}; the two paths must agree"
            )
        out.append({
            "answer": k, "start": s, "tokens": n, "loss_sum": float(nll[i : i + n].sum()),
            "right_tokens": int(right[i : i + n].sum()), "exact": int(exact),
            "generated_exact": int(gen == values[k]),
            "other_value": int(gen != values[k] and gen in values),
        })  # fmt: skip
        i += n
    return out


def score_run(run: str, documents: int, length: int | None, seed: int) -> tuple[list[dict], dict]:
    stored = read_stored_run(run, CONFIG_TARGETS)
    model_config, data = stored.model_config(attn_backend="sdpa"), stored.data_config()
    # the held-out text is the first folder's val split, as the in-loop answer loss reads it
    first_only = {"shards": data.shards[:1], "weights": None} if data.shards else {}
    first = LongCtxDataModule(stored.data_config(**first_only))
    first.prepare_data()
    tokenizer = first.tokenizer()
    length = length or data.seq_len
    text = held_out_text(first, tokenizer)
    docs = answer_documents(tokenizer, text, documents, length, seed, TASKS)
    model = load_model(stored, model_config, "cpu")
    started, rows = time.perf_counter(), []
    for d, (task, tokens, mask) in enumerate(docs):
        rows += [{"doc": d, "task": task, **r} for r in score_document(model, tokens, mask)]
    meta = {
        "run": str(run), "seed": data.seed, "length": length, "documents": documents,
        "arm": arm_label(data.reset_position_ids, data.document_mask), "train_len": data.seq_len,
        "instances_seed": seed, "scoring_seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    return [{"seed": data.seed, **r} for r in rows], meta


def summary(rows: list[dict]) -> dict:
    """Per task and over all: answers, exact rate, token accuracy, answer loss per token, the
    share of answers that are another answer of the document."""

    def cell(mine: list[dict]) -> dict:
        tokens = sum(r["tokens"] for r in mine)
        return {
            "answers": len(mine),
            "exact": float(np.mean([r["exact"] for r in mine])),
            "token_accuracy": sum(r["right_tokens"] for r in mine) / tokens,
            "answer_loss": sum(r["loss_sum"] for r in mine) / tokens,
            "other_value": float(np.mean([r["other_value"] for r in mine])),
        }

    by_task = {task: [r for r in rows if r["task"] == task] for task in TASKS}
    return {**{t: cell(mine) for t, mine in by_task.items() if mine}, "all": cell(rows)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.ood_control", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run folders or checkpoints")
    parser.add_argument("--out", required=True, help="folder for <name>.csv and <name>.json")
    parser.add_argument("--name", default=None, help="default: each run folder's name")
    parser.add_argument("--documents", type=int, default=256, help="the four tasks in turn")
    parser.add_argument("--length", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--instances-seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.documents < 1 or (args.length is not None and args.length < 1):
        raise LongctxError(
            f"--documents {args.documents} --length {args.length}; expected counts >= 1"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise LongctxError(f"--out {out} is a file; expected a folder for the scores")
    if args.name is not None and len(args.runs) > 1:
        raise LongctxError(f"--name {args.name} with {len(args.runs)} runs; expected one run")
    for run in args.runs:
        rows, meta = score_run(run, args.documents, args.length, args.instances_seed)
        name = args.name or Path(run).name
        write_rows(rows, out / f"{name}.csv")
        result = {**meta, "summary": summary(rows)}
        write_json(result, out / f"{name}.json")
        print(json.dumps({"run": name, **result["summary"]["all"]}))


cli = command(main)

if __name__ == "__main__":
    cli()
