"""One run folder, one writer; its first config kept; a start takes back what it added; an
overwrite deletes only a longctx run.

How (the lock, the config kept at ``.hydra/restart-N/``, the ``.longctx-run`` marker that names
its folder, the overwrite renamed aside in one step, the undo of a refused start):
docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import socket
import sys
from pathlib import Path

from longctx.errors import LongctxError
from longctx.io import (
    NotAPlainFile,
    atomic_write_text,
    file_mode,
    own_bytes,
    require_plain_file,
)

LOCK_FILE = ".lock"
RUN_MARKER = ".longctx-run"
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
    runs = (p.parent.parent for p in Path(root).glob(f"*/{CHECKPOINTS}/{LAST_CHECKPOINT}"))
    # hidden: an overwrite's remainder; a link: not a run folder of this root
    found = [r for r in runs if not r.name.startswith(".") and not r.is_symlink()]
    found.sort(key=lambda r: last_checkpoint(r).stat().st_mtime)
    return found[-1] if found else None


class RunFolderRefused(LongctxError):
    """A run folder longctx will not write into, or (overwrite=true) will not delete."""


def named_run(root: Path, name: str) -> Path:
    """The run folder of ``run_name=name``: one folder name directly inside the runs root
    ``root`` (not hidden either: hidden names are an overwrite's remainders)."""
    if not name or "/" in name or name.startswith(".") or len(name.encode()) > NAME_MAX:
        raise RunFolderRefused(
            f"run_name={name!r}: a run name is one folder name inside the runs folder {root} "
            f"(no '/', not '.' or '..', not starting with '.', at most {NAME_MAX} bytes); pick "
            "a plain name such as run_name=arm_a"
        )
    run = Path(root) / name
    check_location(run, root)
    return run


def check_location(run: Path, root: Path) -> None:
    """``run`` is a real folder (or none yet) directly inside ``root`` once symbolic links are
    resolved: a linked run folder would have its target written, and overwritten."""
    if run.is_symlink():
        raise RunFolderRefused(
            f"run folder {run} is a symbolic link (to {os.readlink(run)}); a run folder is a "
            f"real folder inside {root}: remove the link, or move all runs with paths.root_dir"
        )
    real, real_root = Path(os.path.realpath(run)), Path(os.path.realpath(root))
    if real.parent != real_root:
        raise RunFolderRefused(
            f"run folder {run} resolves to {real}, not a folder of the runs folder {real_root}; "
            "pick another run_name"
        )


class RunFolderBusy(LongctxError):
    """Another live process is writing this run folder."""


class RunFolderLock:
    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._file = None

    def acquire(self) -> RunFolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = self._open()
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

    def _open(self):
        """The lock file, created or opened in place (every process must lock the same file) but
        never through a link or a second name: its holder line would be written into another
        file."""
        try:
            require_plain_file(self.path, "the run folder's lock")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, file_mode())
        except (NotAPlainFile, OSError) as err:
            raise RunFolderRefused(str(err)) from None
        return os.fdopen(fd, "r+")

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
    """``hydra.output_subdir``: ``.hydra`` on a run's first start, ``.hydra/restart-N`` after.
    Hydra asks before it writes the config: the last moment to note what the folder held, where
    nothing noted it earlier (then the folder and a job log Hydra just opened count as the
    user's: kept)."""
    note_before_hydra(Path(run_dir))
    base = Path(run_dir) / HYDRA_DIR
    if base.is_symlink():  # Hydra would write its config into the link's target
        raise RunFolderRefused(
            f"{base} is a symbolic link (to {os.readlink(base)}); Hydra writes this start's "
            "config there: remove the link"
        )
    # lexists: Hydra opens the config files for writing, so a link (even a dangling one) there
    # must not be picked: a fresh restart-N folder is
    if not os.path.lexists(base / "config.yaml"):
        return HYDRA_DIR
    n = 1
    while os.path.lexists(base / f"restart-{n}"):
        n += 1
    return f"{HYDRA_DIR}/restart-{n}"


# the longest file name Linux filesystems take (NAME_MAX, in bytes)
NAME_MAX = 255


def sweep_subdir(override_dirname: str, sweep_dir: str | None = None) -> str:
    """``hydra.sweep.subdir``: a sweep job's folder, named after its overrides as Hydra does;
    past a file name's limit (a few long values, a list of tasks), their first bytes and a hash
    of the whole, so the job still starts and two jobs never share a folder. With ``sweep_dir``,
    the job folder's state is noted (Hydra asks before it makes the folder)."""
    subdir, encoded = override_dirname, override_dirname.encode()
    if len(encoded) > NAME_MAX:
        digest = hashlib.sha256(encoded).hexdigest()[:16]
        subdir = encoded[: NAME_MAX - len(digest) - 3].decode(errors="ignore") + f"...{digest}"
    if sweep_dir is not None:
        note_before_hydra(Path(sweep_dir) / subdir)
    return subdir


def existing_checkpoints(checkpoint_dir: Path) -> list[str]:
    """Names of the checkpoints (files or sharded folders) in a run's checkpoints folder."""
    if not checkpoint_dir.is_dir():
        return []
    return sorted(p.name for p in checkpoint_dir.iterdir() if p.suffix == ".ckpt")


@dataclasses.dataclass(frozen=True)
class FolderState:
    """A folder's entries at one moment: every file, folder and link in it ("a/b" relative to
    it), links not followed."""

    existed: bool
    entries: frozenset[str] = frozenset()
    # where the folder did not exist: the outermost of it and its parents that did not (what
    # a ``mkdir -p`` of it makes)
    missing_from: str | None = None

    @classmethod
    def of(cls, folder: Path) -> FolderState:
        folder = Path(folder)
        if not os.path.lexists(folder):
            top = Path(os.path.abspath(folder))
            while not os.path.lexists(top.parent):
                top = top.parent
            return cls(existed=False, missing_from=str(top))
        if folder.is_symlink() or not folder.is_dir():
            return cls(existed=True)
        entries = set()
        for parent, dirs, files in os.walk(folder):  # a linked folder is listed, not entered
            base = Path(parent).relative_to(folder)
            entries |= {(base / name).as_posix() for name in (*dirs, *files)}
        return cls(existed=True, entries=frozenset(entries))


# What each run folder held before Hydra made it or wrote into it, noted as it happens: by the
# run-folder resolver and the sweep-folder resolver (Hydra resolves both before it makes the
# folder), by the Hydra callback for a hydra.run.dir given outright (on_run_start, before the
# job), and at the latest by the config-folder resolver (before Hydra writes the config). The
# first note of a folder is the one kept.
_BEFORE_HYDRA: dict[str, FolderState] = {}


def note_before_hydra(run: Path) -> None:
    _BEFORE_HYDRA.setdefault(os.path.abspath(run), FolderState.of(run))


@dataclasses.dataclass(frozen=True)
class HydraWrites:
    """What Hydra writes into the run folder for this start. None: not known (run() called
    without Hydra, e.g. by a test that imitates a first start)."""

    config_dir: str | None = None  # ".hydra", or ".hydra/restart-N" on a later start
    job_log: str | None = None  # "app.log"

    def kept_on_overwrite(self, previous: frozenset[str], now: frozenset[str]) -> list[str]:
        """Top-level entries an overwrite moves into the new folder: what this start added (but
        its config folder, whose files become .hydra/), the lock this process holds and the job
        log Hydra is writing."""
        added = _top(now - previous) - {HYDRA_DIR}
        return sorted(added | {e for e in _top(now) if e == LOCK_FILE or self._is_job_log(e)})

    def _is_job_log(self, entry: str) -> bool:
        if self.job_log is not None:
            return entry == self.job_log
        return "/" not in entry and entry.endswith(".log")


def marker_text(run: Path) -> str:
    """The run marker of a folder: it names the folder's real path, so a marker copied or moved
    with a run does not verify in its new place."""
    made = {"longctx_run_folder": os.path.realpath(run), "begun_by": holder_description()}
    return json.dumps(made) + "\n"


def marker_verifies(run: Path) -> bool:
    """``run`` holds a run marker made in it: a plain file (not a link) naming this folder."""
    held = own_bytes(Path(run) / RUN_MARKER)
    try:
        made = json.loads(held) if held is not None else None
    except (ValueError, RecursionError):
        return False
    return isinstance(made, dict) and made.get("longctx_run_folder") == os.path.realpath(run)


class RunStart:
    """One start's view of its run folder: what the folder held before it (what a refused start
    takes back), the marker, and the overwrite of a previous run."""

    def __init__(self, run: Path, hydra: HydraWrites) -> None:
        self.run, self.hydra = Path(run), hydra
        noted = _BEFORE_HYDRA.pop(os.path.abspath(run), None)
        # not noted: no Hydra made or wrote the folder (run() called as a library), so it holds
        # now what it held before
        self.before = noted if noted is not None else FolderState.of(self.run)
        self.trained = False  # set once a training step ran: what it wrote is the run's

    def claim(self) -> None:
        """Mark the folder as a longctx run's, when it is this run's: new or empty before this
        start, or marked already."""
        previous = self.before.entries
        marker = self.run / RUN_MARKER
        if (previous and RUN_MARKER not in previous) or os.path.lexists(marker):
            return
        atomic_write_text(marker, marker_text(self.run))

    def start_over(self) -> list[str]:
        """overwrite=true: delete the previous run (moved aside, then removed; see the module
        docstring). Refused, deleting nothing, when the folder's marker does not verify.
        Returns the top-level names deleted."""
        previous = self.before.entries
        if not previous:
            return []
        if RUN_MARKER not in previous or not marker_verifies(self.run):
            self._refuse_overwrite(previous)
        keep = self.hydra.kept_on_overwrite(previous, FolderState.of(self.run).entries)
        removed = sorted(
            e + ("/" if (self.run / e).is_dir() else "")
            for e in _top(previous) - {*keep, RUN_MARKER}  # the marker: written again
        )
        aside = self.run.with_name(f".{self.run.name}.overwritten-{secrets.token_hex(4)}")
        try:  # one step: the run is whole, or no longer under its name
            os.rename(self.run, aside)
        except OSError as err:  # a folder it cannot write, a mount point
            raise RunFolderRefused(
                f"overwrite=true: cannot move {self.run} aside to delete it ({err}); nothing "
                "was deleted"
            ) from None
        self._move_back(aside, keep)
        _remove_tree(aside)
        self.before = FolderState(existed=False)  # nothing of the folder is another start's now
        return removed

    def _refuse_overwrite(self, previous: frozenset[str]) -> None:
        shown = ", ".join(sorted(e for e in previous if "/" not in e)[:5])
        why = (
            f"is not marked as a longctx run (no {RUN_MARKER}; it holds {shown})"
            if RUN_MARKER not in previous
            else f"has a {RUN_MARKER} that was not made in this folder (copied or moved with a "
            "run, written by a longctx before markers named their folder, or not longctx's)"
        )
        raise RunFolderRefused(
            f"overwrite=true: {self.run} {why}, so nothing was deleted; delete it yourself, or "
            "pick another run_name"
        )

    def _move_back(self, aside: Path, keep: list[str]) -> None:
        try:
            self.run.mkdir()
        except FileExistsError:
            raise RunFolderRefused(
                f"overwrite=true: {self.run} was made again by another process while the "
                f"previous run was moved to {aside}; nothing was deleted"
            ) from None
        for name in keep:
            if os.path.lexists(aside / name):
                os.rename(aside / name, self.run / name)
        if self.hydra.config_dir is not None and (aside / self.hydra.config_dir).is_dir():
            (self.run / HYDRA_DIR).mkdir()
            for name in HYDRA_FILES:  # this start's config becomes the folder's first
                if (aside / self.hydra.config_dir / name).is_file():
                    os.rename(aside / self.hydra.config_dir / name, self.run / HYDRA_DIR / name)

    def undo(self) -> bool:
        """Remove what this (refused) start added, unless it trained (a step ran, or it wrote a
        checkpoint: what it wrote is the run's); then the folder, when this start made it and
        nothing is left. Returns whether the folder was removed."""
        if self.trained or self.run.is_symlink() or not self.run.is_dir():
            return False
        added = FolderState.of(self.run).entries - self.before.entries
        if any(e.startswith(f"{CHECKPOINTS}/") for e in added):
            return False
        for entry in sorted(added, reverse=True):  # what is inside a folder before the folder
            _remove_entry(self.run / entry)
        if self.before.existed:
            return False
        folder, top = Path(os.path.abspath(self.run)), self.before.missing_from
        if not _remove_entry(folder):
            return False
        while top is not None and folder != Path(top) and _remove_entry(folder.parent):
            folder = folder.parent  # the parents its mkdir made, each only if empty
        return True


def _top(entries: frozenset[str]) -> set[str]:
    return {e for e in entries if "/" not in e}


def _remove_entry(path: Path) -> bool:
    """Unlink a file or link; remove a folder only if empty (what else is in it is not ours)."""
    try:
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    except OSError:
        return False
    return True


def _remove_tree(folder: Path) -> None:
    """rmtree never follows a link inside (it unlinks it). What cannot be removed is said."""
    try:
        shutil.rmtree(folder)
    except OSError as err:
        print(f"warning: could not delete all of {folder} ({err}); delete it yourself",
              file=sys.stderr, flush=True)  # fmt: skip


def what_a_stop_kept(run: Path) -> str:
    """What a run stopped in training (a non-finite step) leaves, for its message."""
    names = existing_checkpoints(checkpoint_dir(run))
    if names:
        return (
            f"its checkpoints ({', '.join(names)}) hold finite steps only: ckpt_path=last "
            "resumes the newest"
        )
    shown = sorted(p.name for p in Path(run).iterdir() if not p.name.startswith("."))
    return (
        f"no checkpoint was written before it; the run folder {run} keeps what it logged "
        f"({', '.join(shown) or 'nothing yet'})"
    )
