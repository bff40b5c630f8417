"""The run folders of a sweep and what each one's record says (longctx.runs.record).

A run folder is what train.py writes (it holds checkpoints/), or its archive: the same files
without the checkpoints and with the run's record as JSON (studies.archive), which
the reports read alike."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from longctx.errors import LongctxError
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.folder import CHECKPOINTS, is_run_folder
from longctx.runs.record import RecordError, RecordTargets, read_stored_run, validated_config

RECORD_FILE = "run_record.json"  # an archived run's record, in place of its checkpoints
CSV_LOG = Path("csv") / "metrics.csv"  # every run's metrics (gzipped in an archive)


def metrics_log(run_dir: Path) -> Path | None:
    """The run's metrics log: train.py's CSV, or its archive's gzipped copy."""
    for path in (run_dir / CSV_LOG, run_dir / CSV_LOG.with_name(CSV_LOG.name + ".gz")):
        if path.is_file():
            return path
    return None


def is_archived_run(path: Path) -> bool:
    return (path / RECORD_FILE).is_file() and not is_run_folder(path)


def find_runs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included): folders holding checkpoints/, or
    archived runs."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such folder: {root}")
    found = {p.parent for p in root.rglob(CHECKPOINTS) if p.is_dir() and is_run_folder(p.parent)}
    found |= {p.parent for p in root.rglob(RECORD_FILE) if is_archived_run(p.parent)}
    return sorted(found)


def require_runs(root: str | Path) -> list[Path]:
    runs = find_runs(root)
    if not runs:
        raise FileNotFoundError(
            f"no run folders under {root}: expected folders with {CHECKPOINTS}/ as train.py "
            f"writes them, or archived runs ({RECORD_FILE})"
        )
    return runs


def read_record_file(path: str | Path, targets: RecordTargets) -> dict:
    """The validated record a run's archive keeps in place of its checkpoints (a JSON file of
    ``{"identity", "config"}``, studies.archive): the same checks as a checkpoint's."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise RecordError(f"{path} is not a readable run record ({err}); expected JSON") from err
    validated_config(record, path, None, "the record studies.archive writes", targets)
    return record


def run_settings(run_dir: Path) -> dict:
    """{"model", "data", "run"} of the run as its last checkpoint (or its archive) records
    them ("run": group, seed and tags)."""
    if is_archived_run(run_dir):
        config = read_record_file(run_dir / RECORD_FILE, CONFIG_TARGETS)["config"]
    else:
        config = read_stored_run(run_dir, CONFIG_TARGETS).config
    return {"run": {}, **config}


def run_name(run_dir: Path, root: Path) -> str:
    return str(run_dir.relative_to(root)) if run_dir != root else run_dir.name


def read_table(
    path: Path, numeric: Sequence[str] = (), text: Sequence[str] = (), sparse: bool = False
) -> pd.DataFrame:
    """A CSV a report reads (gzipped when its name ends .gz): rows, the ``text`` columns it
    groups by, and the ``numeric`` columns it computes with, holding a finite number in every
    row (``sparse``: every column but ``text`` numeric, a cell may be empty, as in a metrics
    log). A file that cannot be read (a damaged gzip archive, not CSV), holds no rows, lacks a
    column, or holds a value that is not a number is one line naming the file and the column,
    not a traceback (or a NaN) in the middle of a report."""
    try:
        frame = pd.read_csv(path)
    except (OSError, EOFError, zlib.error, ValueError, UnicodeDecodeError) as err:
        raise LongctxError(
            f"{path} cannot be read as {'a gzip-compressed ' if path.suffix == '.gz' else 'a '}"
            f"CSV table ({type(err).__name__}: {' '.join(str(err).split())[:200]}); expected "
            "the file as longctx wrote it"
        ) from None
    expected = "; expected the file as longctx wrote it"
    if frame.empty:
        raise LongctxError(f"{path} holds no rows{expected}")
    for column in (*numeric, *text):
        if column not in frame.columns:
            raise LongctxError(f"{path} has no {column!r} column (columns "
                             f"{list(frame.columns)[:8]}){expected}")  # fmt: skip
    for column in [c for c in frame.columns if c not in text] if sparse else numeric:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = values.isna() & frame[column].notna() if sparse else ~np.isfinite(values)
        if bad.any():
            row = int(np.argmax(bad.to_numpy()))
            value = frame[column].iloc[row]
            shown = "an empty cell" if pd.isna(value) else repr(value if isinstance(value, str)
                                                                else float(value))  # fmt: skip
            raise LongctxError(f"{path}: column {column!r} holds {shown} (row {row + 2}), not a "
                             f"finite number{expected}")  # fmt: skip
        frame[column] = values
    return frame


def read_json_file(path: Path, what: str) -> object:
    """A JSON file a report reads: unreadable, not JSON or nested too deep is one line naming
    it (``what``: the file's role, for the message)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise LongctxError(
            f"{path} cannot be read as {what} ({type(err).__name__}: "
            f"{' '.join(str(err).split())[:200]}); expected the file as longctx wrote it"
        ) from None
