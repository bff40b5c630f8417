"""python -m studies.archive RUNS DEST: a sweep's results, kept without its checkpoints.

A result run's checkpoints stay on the machine that trained it (they are never committed). What
the reports read (the metrics log, the suite's and the evaluations' files, Hydra's config) is
copied to DEST under the same relative paths, with the record that the run's last checkpoint
carries (its identity and model/data config, validated) as ``run_record.json``. The reports
(ruler_report, extension_report, analysis) read an archived run as they read the run folder, so
every number they print can be recomputed from committed files. The metrics log is gzipped (a
run logs every step: ~6 MB at 50,000 steps).

Archiving a run again replaces its archive in one rename; a DEST folder that is not an archived
run is never replaced. The copy is built in a fresh hidden folder beside DEST, and the archive it
replaces is moved to another: both made here under unique names, so nothing beside DEST that
this command did not make is ever removed (an interrupted archive leaves its hidden folder).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from longctx.cli import command
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.io import make_readable
from longctx.runs.folder import CHECKPOINTS, LOCK_FILE, RUN_MARKER
from longctx.runs.record import read_stored_run
from studies.sweep_files import CSV_LOG, RECORD_FILE, is_archived_run, require_runs

# a run folder's own: its checkpoints (kept where they were trained), its lock, and the marker
# that lets `overwrite` delete it (an archive is not a run folder)
NOT_ARCHIVED = {CHECKPOINTS, LOCK_FILE, RUN_MARKER}


def archive_run(run: Path, dest: Path) -> Path:
    """Copy ``run``'s results to ``dest`` (see the module docstring); returns ``dest``."""
    # refuses a run without a valid record before anything is written
    stored = read_stored_run(run, CONFIG_TARGETS)
    if dest.exists() and not is_archived_run(dest):
        raise FileExistsError(
            f"{dest} exists and is not an archived run ({RECORD_FILE}); not replacing it"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".new", dir=dest.parent))
    try:
        _fill(run, staging, stored)
        _replace(dest, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # made above: ours to remove
        raise
    return dest


def _fill(run: Path, staging: Path, stored) -> None:
    """The archive's contents, copied into ``staging`` (a fresh folder of this command's)."""
    shutil.copytree(run, staging, ignore=functools.partial(_not_archived, run), dirs_exist_ok=True)
    make_readable(staging)  # mkdtemp made it 0700
    log = staging / CSV_LOG
    if log.is_file():
        with log.open("rb") as src, gzip.open(log.with_name(log.name + ".gz"), "wb") as out:
            shutil.copyfileobj(src, out)
        log.unlink()
    record = {"identity": stored.identity, "config": stored.config}
    (staging / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _replace(dest: Path, staging: Path) -> None:
    """``staging`` renamed to ``dest``; an earlier archive there first moved onto a fresh empty
    folder of this command's (rename replaces an empty folder), then removed. A link at
    ``dest`` is replaced (unlinked), its target untouched."""
    if dest.is_symlink():
        dest.unlink()
    if not os.path.lexists(dest):
        staging.rename(dest)
        return
    previous = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".old", dir=dest.parent))
    try:
        dest.rename(previous)
    except BaseException:
        previous.rmdir()  # still the empty folder made above
        raise
    staging.rename(dest)
    shutil.rmtree(previous, ignore_errors=True)


def _not_archived(run: Path, folder: str, names: list[str]) -> list[str]:
    """What copytree leaves out: the run folder's own files, and links (a link's target is not
    the run's result, and a committed link points nowhere)."""
    top = Path(folder) == run
    return [n for n in names if (top and n in NOT_ARCHIVED) or (Path(folder) / n).is_symlink()]


def archive_runs(root: Path, dest: Path) -> list[Path]:
    """Every run folder under ``root`` archived to the same relative path under ``dest``."""
    runs = [r for r in require_runs(root) if not is_archived_run(r)]
    if not runs:
        raise FileNotFoundError(
            f"{root} holds only archived runs; expected run folders with {CHECKPOINTS}/"
        )
    return [archive_run(run, dest / run.relative_to(root)) for run in runs]


def main(argv: Sequence[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(
        prog="python -m studies.archive", description=__doc__.split("\n")[0]
    )
    p.add_argument("runs", type=Path, help="a folder of run folders (any depth), or one run folder")
    p.add_argument("dest", type=Path, help="where their archives go (same relative paths)")
    args = p.parse_args(argv)
    archived = archive_runs(args.runs, args.dest)
    for folder in archived:
        print(f"archived {folder}")
    return archived


cli = command(main)  # one-line errors, exit 2

if __name__ == "__main__":
    cli()
