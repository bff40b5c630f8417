"""Result files of the evaluation: CSV tables and standard JSON, each written fresh (a temp file
renamed over the old one: a link in the output folder is replaced, never written through); and
the W&B runs a trainer's callbacks log their tables to."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from longctx.io import atomic_append_bytes, atomic_write_text

# The files an evaluation writes into its output folder: a run's EVAL_DIR when train.py's
# callbacks or ``python -m longctx.eval`` on its checkpoint score it (or --out); the reports
# (studies) read them back by these names.
EVAL_DIR = "eval"
EVAL_SUMMARY_JSON = "eval.json"
POSITION_LOSS_CSV = "position_loss.csv"
LONG_DOCUMENTS_CSV = "long_documents.csv"
LONG_DOCUMENT_OCTAVES_CSV = "long_documents_by_octave.csv"  # per document and octave: for CIs
PASSKEY_PROBES_CSV = "passkey_probes.csv"
PASSKEY_ACCURACY_CSV = "passkey_accuracy.csv"
HELD_OUT_DOCUMENTS_CSV = "held_out_documents.csv"
HELD_OUT_ANSWERS_CSV = "held_out_answers.csv"
RULER_RESULTS_CSV = "ruler_results.csv"
RULER_SUMMARY_JSON = "ruler.json"


def write_rows(rows: Sequence[dict], path: Path) -> None:
    """Dict rows as a CSV table (replacing the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, pd.DataFrame(list(rows)).to_csv(index=False))


def append_rows(rows: Sequence[dict], path: Path) -> None:
    """Append dict rows to a CSV, the header first when the file is new (or was a link)."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(list(rows)).to_csv(index=False).encode()
    header, body = table.split(b"\n", 1)
    atomic_append_bytes(path, body, head=header + b"\n")


def write_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(_json_safe(obj), indent=2) + "\n")


def _json_safe(obj):
    """NaN/inf -> None, so the JSON is standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def callback_out(trainer, out_dir: str | None) -> Path:
    """A callback's output folder: ``out_dir``, else the run folder's EVAL_DIR."""
    return Path(out_dir or Path(trainer.default_root_dir) / EVAL_DIR)


def log_wandb(trainer, payload: Callable[[Any], dict]) -> None:
    """Log ``payload(wandb)`` to the trainer's WandbLoggers' runs; wandb is imported only when
    there is one (it is an optional dependency)."""
    from lightning.pytorch.loggers import WandbLogger

    runs = [lg.experiment for lg in trainer.loggers if isinstance(lg, WandbLogger)]
    if not runs:
        return
    import wandb

    logged = payload(wandb)
    for run in runs:
        run.log(logged)
