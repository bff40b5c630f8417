"""Result files of the evaluation: CSV tables and standard JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd


def write_rows(rows: Sequence[dict], path: Path) -> None:
    """Dict rows as a CSV table (replacing the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(rows)).to_csv(path, index=False)


def append_rows(rows: Sequence[dict], path: Path) -> None:
    """Append dict rows to a CSV, writing the header when the file is new."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(list(rows)).to_csv(path, mode="a", header=not path.exists(), index=False)


def write_json(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(obj), indent=2) + "\n")


def _json_safe(obj):
    """NaN/inf -> None, so the JSON is standard."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj
