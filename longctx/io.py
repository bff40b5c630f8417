"""Atomic writes: a file appears whole or not at all, so a crash mid-write never leaves one
that a reader (a resume, a shard reader) would trust."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# temp files of an atomic write: a prefix no user file is expected to have, so cleaning up
# after an interrupted write never touches files that are not ours; the ".tmp" suffix keeps
# them among the ".*.tmp" leftovers a checkpoint folder's cleanup removes
TEMP_PREFIX = ".longctx-tmp-"


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temp name in the same folder, fsynced, then
    renamed over ``path`` (the rename made durable too); on an error, no file and no temp."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache or run folder must be readable
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def remove_temp_files(folder: str | os.PathLike, stem: str = "") -> None:
    """Drop leftovers of interrupted writes: only ours, and with ``stem`` only those of files
    named ``stem*`` (one task's, while others write)."""
    for path in Path(folder).glob(f"{TEMP_PREFIX}{stem}*"):
        path.unlink(missing_ok=True)
