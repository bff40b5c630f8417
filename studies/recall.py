"""Score trained runs on held-out MQAR instances (studies.recall_conditions) and write per-instance
CSVs: the associative-recall study's readout (docs/recall.md).

    python -m studies.recall RUN [RUN ...] --out DIR [--generate in_distribution]
    python -m studies.recall RUN --out DIR --positions swapped   # the masked pair, same weights

Every run is scored on the same instances (drawn from ``--instances-seed``, streams the training
corpus never uses), read under its own arm (document mask, position ids), at its own row length
L: ``in_distribution`` and ``interference`` rows of L, ``length`` documents whose queries sit
past the longest training document, up to 2L. Teacher-forced on every instance; with
``--generate``, also through greedy generation from the KV cache, and the two must agree.
``--positions swapped`` reads a run under the other position ids than it trained with (reset
for continuous, continuous for reset): under document masks and RoPE the same weights must
answer the same up to rounding (the study's control of the masked pair).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.cli import command
from longctx.data.config import MqarCorpus
from longctx.data.shards import load_manifest
from longctx.errors import LongctxError
from longctx.eval.cli import load_model
from longctx.eval.files import write_json, write_rows
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.record import read_stored_run
from longctx.synthetic.mqar import KIND, MqarSpec, MqarVocab
from studies.recall_conditions import (
    CONDITIONS,
    Arm,
    RecallRow,
    anchor_document,
    generated,
    in_distribution_row,
    interference_row,
    length_document,
    records,
    teacher_forced,
)

EVAL_STREAM = 0x72656361  # the instances' streams: [seed, EVAL_STREAM, condition, i]
LENGTH_PAIRS = 8  # pairs of a length-condition document
INTERFERENCE_ROWS = 4  # interference rows per --rows


def length_distances(spec: MqarSpec, seq_len: int) -> list[int]:
    """The length condition's first-query distances: inside the training documents, then
    doubling from past the longest one to 2L."""
    out, d = [spec.max_doc_len // 2], 2 ** math.ceil(math.log2(spec.max_doc_len + 1))
    while d <= 2 * seq_len:
        out.append(d)
        d *= 2
    return out


def instances(spec: MqarSpec, seq_len: int, seed: int, rows: int, docs: int) -> list[RecallRow]:
    """``rows`` in-distribution and 4x ``rows`` interference rows of ``seq_len``, ``docs``
    length documents per distance, and ``docs`` anchor documents."""

    def rng(condition: int, i: int) -> np.random.Generator:
        return np.random.default_rng([seed, EVAL_STREAM, condition, i])

    out = [in_distribution_row(rng(0, i), spec, seq_len) for i in range(rows)]
    # an interference row scores its last document only: four times the rows for its share
    out += [interference_row(rng(1, i), spec, seq_len) for i in range(INTERFERENCE_ROWS * rows)]
    for j, distance in enumerate(length_distances(spec, seq_len)):
        out += [
            length_document(rng(2, j * docs + i), spec, LENGTH_PAIRS, distance) for i in range(docs)
        ]
    out += [anchor_document(rng(3, i), spec) for i in range(docs)]
    return out


def corpus_spec(folder: str | Path) -> MqarSpec:
    """The document distribution an MQAR corpus folder was written with (its manifest)."""
    manifest = load_manifest(folder)
    sources = manifest.sources
    if manifest.tokenizer.get("kind") != KIND or len(sources) != 1 or "spec" not in sources[0]:
        raise LongctxError(
            f"{folder} is not an MQAR corpus (its tokenizer is {manifest.tokenizer.get('kind')!r});"
            " expected a folder written by python -m longctx.data.mqar_corpus"
        )
    spec = dict(sources[0]["spec"])
    return MqarSpec(MqarVocab(**spec.pop("vocab")), **spec)


def trained_spec(run, data) -> MqarSpec:
    """The document distribution of the one MQAR corpus a run trained on (a ``{mqar: {...}}``
    entry or a prepared MQAR folder)."""
    from longctx.data.corpus import EMBEDDED

    entries = data.shards or []
    if len(entries) == 1 and isinstance(entries[0], MqarCorpus):
        return entries[0].spec()  # its settings say it all: no need to write it
    if len(entries) == 1 and isinstance(entries[0], str) and entries[0] != EMBEDDED:
        try:
            return corpus_spec(entries[0])
        except (LongctxError, FileNotFoundError) as err:
            raise LongctxError(f"{run}: data.shards={entries!r}: {err}") from None
    raise LongctxError(
        f"{run} was trained on data.shards={entries!r}; expected one MQAR corpus "
        "(data.shards=[{mqar: {...}}], as experiment=recall, or an MQAR folder)"
    )


def score_run(run: str, args: argparse.Namespace) -> tuple[list[dict], dict]:
    stored = read_stored_run(run, CONFIG_TARGETS)
    model_config, data = stored.model_config(attn_backend="sdpa"), stored.data_config()
    spec = trained_spec(run, data)
    swapped = args.positions == "swapped"
    arm = Arm(data.document_mask, data.reset_position_ids != swapped)
    model = load_model(stored, model_config, "cpu")
    rows = instances(spec, data.seq_len, args.instances_seed, args.rows, args.docs)
    started, out = time.perf_counter(), []
    for condition in CONDITIONS:
        mine = [r for r in rows if r.condition == condition]
        for i, row in enumerate(mine):
            tf = teacher_forced(model, [row], arm)
            gen = generated(model, row, arm) if condition in args.generate else None
            for k, rec in enumerate(records([row], tf)):
                rec["row"] = i
                rec["generated"] = "" if gen is None else int(gen[k])
                if gen is not None and gen[k] != tf[k]:
                    raise RuntimeError(
                        f"{run}: {condition} row {i} query {k}: generation gave {gen[k]}, "
                        f"teacher forcing {tf[k]}; the two paths must agree"
                    )
                out.append(rec)
    meta = {
        "run": str(run), "seed": stored.identity.get("seed", _seed(stored)),
        "document_mask": data.document_mask, "reset_position_ids": data.reset_position_ids,
        **({"read_reset_position_ids": arm.reset_position_ids} if swapped else {}),
        "seq_len": data.seq_len, "max_doc_len": spec.max_doc_len,
        "scoring_seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    return [{**meta_cols(meta), **r} for r in out], meta


def _seed(stored) -> int | None:
    return stored.data_config().seed


def meta_cols(meta: dict) -> dict:
    return {k: meta[k] for k in ("seed", "document_mask", "reset_position_ids")}


def summary(rows: list[dict]) -> dict:
    """Accuracy per condition (and per distance for the length condition)."""
    out: dict = {}
    for condition in CONDITIONS:
        mine = [r for r in rows if r["condition"] == condition]
        if not mine:
            continue
        cell = {"accuracy": float(np.mean([r["correct"] for r in mine])), "n": len(mine)}
        if condition == "length":
            cell["by_distance"] = {
                str(d): float(np.mean([r["correct"] for r in mine if r["target_distance"] == d]))
                for d in sorted({r["target_distance"] for r in mine})
            }
        out[condition] = cell
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.recall", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run folders or checkpoints")
    parser.add_argument("--out", required=True, help="folder for <name>.csv and <name>.json")
    parser.add_argument("--name", default=None, help="default: each run folder's name")
    parser.add_argument("--instances-seed", type=int, default=0)
    parser.add_argument(
        "--rows",
        type=int,
        default=8,
        help="in-distribution rows (and 4x as many interference rows)",
    )
    parser.add_argument("--docs", type=int, default=16, help="length documents per distance")
    parser.add_argument("--generate", nargs="*", default=[], choices=CONDITIONS)
    parser.add_argument("--positions", choices=("own", "swapped"), default="own",
                        help="read under the run's position ids or the other ones")  # fmt: skip
    args = parser.parse_args(argv)
    if min(args.rows, args.docs) < 0 or args.rows + args.docs == 0:
        raise LongctxError(
            f"--rows {args.rows} --docs {args.docs}; expected counts >= 0, not both 0"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise LongctxError(f"--out {out} is a file; expected a folder for the scores")
    for run in args.runs:
        rows, meta = score_run(run, args)
        name = args.name or Path(run).name
        write_rows(rows, out / f"{name}.csv")
        result = {**meta, "summary": summary(rows)}
        write_json(result, out / f"{name}.json")
        print(json.dumps({"run": name, **result["summary"]}))


cli = command(main)

if __name__ == "__main__":
    cli()
