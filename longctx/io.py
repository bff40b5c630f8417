"""Atomic writes: a file appears whole or not at all, so a crash mid-write never leaves one
that a reader (a resume, a shard reader) would trust. Every file longctx writes into a folder is
created fresh (a temp name, then a rename over the destination): an existing path is never opened
for writing, so a symbolic link or a second hard link placed there (in a run folder someone
handed over, say) is replaced, never written through. And the modes of what longctx writes
for others to read (run folders, prepared data, exports): files 0644 and folders 0755 under
the usual umask 022, the user's umask otherwise -- what ``open`` and ``mkdir`` give, where
``mkstemp`` (0600), ``mkdtemp`` (0700) and safetensors (0600) give less."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from longctx.errors import LongctxError

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
    os.chmod(tmp, file_mode())  # mkstemp makes 0600; a shared cache or run folder must be readable
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


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_once(path: str | os.PathLike, data: bytes) -> bytes:
    """Put ``data`` at ``path`` unless a file of its own is already there, and return what
    ``path`` holds: writers racing (every rank of a job starting at once) all get the first
    one's bytes, since a hard link to a finished temp file appears whole and never replaces.
    A link or a non-file there is not ours: it is replaced by ``data``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", suffix=".tmp", dir=path.parent)
    os.chmod(tmp, file_mode())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if (kept := own_bytes(path)) is not None:
                return kept
            os.replace(tmp, path)
        return data
    finally:
        Path(tmp).unlink(missing_ok=True)


def own_bytes(path: str | os.PathLike) -> bytes | None:
    """The bytes of ``path`` when it is a plain file (not a link, which is not followed); None
    for anything else or nothing. What an append keeps: a link's target is not ours to copy."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as err:
        if err.errno == errno.ELOOP:  # a symbolic link
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a fifo: not a file to copy
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def atomic_append_bytes(path: str | os.PathLike, data: bytes, head: bytes = b"") -> None:
    """Append ``data`` to ``path`` by writing a fresh file (its earlier bytes, then ``data``) over
    it; ``head`` starts a file that had none (a table's header). A link at ``path`` is replaced,
    its target neither read nor written."""
    earlier = own_bytes(path)
    atomic_write_bytes(path, (head if earlier is None else earlier) + data)


class NotAPlainFile(LongctxError):
    """A path longctx would append to in place is a link, a second name of a file, or no file."""


def require_plain_file(path: str | os.PathLike, what: str) -> None:
    """Refuse ``path`` unless it is absent or a plain file under this one name (not a symbolic
    link, one hard link): for files appended in place, where replacing a link would lose the
    history it stands for and writing through it would change another file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        shown = f"a symbolic link (to {os.readlink(path)})"
    elif not stat.S_ISREG(st.st_mode):
        shown = "not a plain file"
    elif st.st_nlink > 1:
        shown = f"a file with {st.st_nlink} names (hard links)"
    else:
        return
    raise NotAPlainFile(
        f"{what} {path} is {shown}; longctx writes it in place only as a plain file of its "
        "own: put the file itself there, or remove it"
    )


def remove_temp_files(folder: str | os.PathLike, stem: str = "") -> None:
    """Drop leftovers of interrupted writes: only ours, and with ``stem`` only those of files
    named ``stem*`` (one task's, while others write)."""
    for path in Path(folder).glob(f"{TEMP_PREFIX}{stem}*"):
        path.unlink(missing_ok=True)


def umask() -> int:
    """The process's umask, read without changing it where Linux shows it (os.umask can only
    read by setting, which races with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open`` gives a new file: 0666 less the umask (0644 under 022)."""
    return 0o666 & ~umask()


def folder_mode() -> int:
    """The mode ``mkdir`` gives a new folder: 0777 less the umask (0755 under 022)."""
    return 0o777 & ~umask()


def make_readable(root: str | os.PathLike) -> None:
    """Give ``root`` and everything under it the modes a plain ``open``/``mkdir`` would have:
    for trees built through mkdtemp or by writers that make private files (safetensors)."""
    root = Path(root)
    files, folders = file_mode(), folder_mode()
    os.chmod(root, folders)
    for parent, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(parent, name), folders)
        for name in filenames:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, files)
