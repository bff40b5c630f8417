"""The run folders of a sweep and what each one's record says (longctx.runs.record)."""

from __future__ import annotations

from pathlib import Path

from longctx.runs.folder import CHECKPOINTS, is_run_folder
from longctx.runs.record import read_stored_run


def find_runs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (``root`` itself included): folders holding checkpoints/."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such folder: {root}")
    found = {p.parent for p in root.rglob(CHECKPOINTS) if p.is_dir()}
    return sorted(p for p in found if is_run_folder(p))


def require_runs(root: str | Path) -> list[Path]:
    runs = find_runs(root)
    if not runs:
        raise FileNotFoundError(
            f"no run folders under {root}: expected folders with {CHECKPOINTS}/ as train.py "
            "writes them"
        )
    return runs


def run_settings(run_dir: Path) -> dict:
    """{"model", "data", "run"} of the run as its last checkpoint records them ("run": group,
    seed and tags)."""
    config = read_stored_run(run_dir).config
    return {"run": {}, **config}


def run_name(run_dir: Path, root: Path) -> str:
    return str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
