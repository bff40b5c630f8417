"""One run folder, one writer; its first config kept; nothing left behind by a failed start.

* Lock. The process that trains into a run folder (global rank 0) holds an exclusive
  ``flock`` on ``<run>/.lock`` for its whole life; the file names the holder. A second run
  into the same folder is refused, naming it. The kernel drops the lock when the holder dies
  (kill -9 included), so a crashed run never blocks its own resume.
* Config. Hydra writes ``.hydra/config.yaml`` at every start. The first start of a run keeps
  that place; every later start (a resume, a refused attempt) writes ``.hydra/restart-N/``,
  so the run's original config is never overwritten.
* Cleanup. A start that fails its config checks removes the run folder again when it holds
  nothing but what that start wrote (Hydra's bookkeeping, the lock).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import os
import shutil
import socket
import sys
from pathlib import Path

LOCK_FILE = ".lock"
HYDRA_DIR = ".hydra"
HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}
CHECKPOINTS = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"


def checkpoint_dir(run: Path) -> Path:
    return Path(run) / CHECKPOINTS


def last_checkpoint(run: Path) -> Path:
    """Where the run's newest checkpoint is kept (a file, or a sharded folder under FSDP2)."""
    return checkpoint_dir(run) / LAST_CHECKPOINT


def is_run_folder(path: Path) -> bool:
    return checkpoint_dir(path).is_dir()


def run_folder_of(path: Path) -> Path | None:
    """The run folder ``path`` is (a folder holding checkpoints/) or lies in (a checkpoint in
    run/checkpoints/); None for a checkpoint that lives elsewhere."""
    path = Path(path)
    if is_run_folder(path):
        return path
    if path.parent.name == CHECKPOINTS:
        return path.parent.parent
    return None


def newest_resumable_run(root: Path) -> Path | None:
    """The run under ``root`` whose last checkpoint was written most recently."""
    found = sorted(Path(root).glob(f"*/{CHECKPOINTS}/{LAST_CHECKPOINT}"), key=_mtime)
    return found[-1].parent.parent if found else None


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


class RunFolderBusy(RuntimeError):
    """Another live process is writing this run folder."""


class RunFolderLock:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._file = None

    def acquire(self) -> RunFolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # noqa: SIM115 -- held open for the run's life
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "an unknown process"
            file.close()
            raise RunFolderBusy(
                f"run folder {self.path.parent} is in use by {holder} (lock {self.path}); "
                "one run writes a folder at a time: wait for it, stop it, or pick another "
                "run_name"
            ) from None
        file.seek(0)
        file.truncate()
        file.write(f"{holder_description()}\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def holder_description() -> str:
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    command = " ".join(sys.argv)[:500]
    return f"pid {os.getpid()} on host {socket.gethostname()} since {since} ({command})"


def config_subdir(run_dir: str) -> str:
    """``hydra.output_subdir``: ``.hydra`` on a run's first start, ``.hydra/restart-N`` after."""
    base = Path(run_dir) / HYDRA_DIR
    if not (base / "config.yaml").exists():
        return HYDRA_DIR
    n = 1
    while (base / f"restart-{n}").exists():
        n += 1
    return f"{HYDRA_DIR}/restart-{n}"


# the longest file name Linux filesystems take (NAME_MAX, in bytes)
NAME_MAX = 255


def sweep_subdir(override_dirname: str) -> str:
    """``hydra.sweep.subdir``: a sweep job's folder, named after its overrides as Hydra does;
    past a file name's limit (a few long values, a list of tasks), their first bytes and a hash
    of the whole, so the job still starts and two jobs never share a folder."""
    name = override_dirname.encode()
    if len(name) <= NAME_MAX:
        return override_dirname
    digest = hashlib.sha256(name).hexdigest()[:16]
    return name[: NAME_MAX - len(digest) - 3].decode(errors="ignore") + f"...{digest}"


def remove_if_only_bookkeeping(run_dir: Path) -> bool:
    """Delete ``run_dir`` when it holds only what failed starts write: Hydra's config files
    (``.hydra``, its ``restart-N``), Hydra's job log (``*.log``) and the lock file. A start
    that fails its checks leaves no empty run folder behind. Returns whether it was removed."""
    if not run_dir.is_dir():
        return False
    for entry in run_dir.iterdir():
        if entry.is_file() and (entry.name == LOCK_FILE or entry.suffix == ".log"):
            continue
        if entry.name == HYDRA_DIR and _only_hydra_files(entry):
            continue
        return False
    shutil.rmtree(run_dir)
    return True


def _only_hydra_files(folder: Path) -> bool:
    return all(p.is_dir() or p.name in HYDRA_FILES for p in folder.rglob("*"))


def existing_checkpoints(checkpoint_dir: Path) -> list[str]:
    """Names of the checkpoints (files or sharded folders) in a run's checkpoints folder."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p.name for p in checkpoint_dir.iterdir() if p.suffix == ".ckpt")


def snapshot(run_dir: Path) -> set[Path]:
    """Every file in ``run_dir`` now (to tell later what a start added)."""
    return {p for p in Path(run_dir).rglob("*") if p.is_file()} if Path(run_dir).is_dir() else set()


def undo_start(run_dir: Path, before: set[Path]) -> bool:
    """Remove what a refused start added to ``run_dir`` (its log and metrics folders, its W&B
    files), unless it wrote a checkpoint, and then the folder itself when nothing but failed
    starts' bookkeeping is left. Returns whether the folder was removed."""
    added = snapshot(run_dir) - before
    if any(p.is_relative_to(checkpoint_dir(run_dir)) for p in added):
        return False  # a refusal after training began: what it wrote is the run's
    for path in added:
        if path.name != LOCK_FILE and path.suffix != ".log" and HYDRA_DIR not in path.parts:
            path.unlink(missing_ok=True)
    _remove_empty_folders(Path(run_dir))
    return remove_if_only_bookkeeping(Path(run_dir))


def _remove_empty_folders(root: Path) -> None:
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if not any(folder.iterdir()):
            folder.rmdir()
