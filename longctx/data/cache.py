"""The cache: where the folders longctx prepares on first use live, and how one is written once.

``$LONGCTX_CACHE`` (default ``~/.cache/longctx``) holds the embedded corpus, synthesized mixes,
MQAR corpora (each named by its settings) and the Llama 3 tokenizer built from its model file.
A folder is written under a file lock, so DDP ranks that ask for it at once write it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from longctx.data.shards import MANIFEST_NAME


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else $LONGCTX_CACHE, else ~/.cache/longctx."""
    root = cache_dir or os.environ.get("LONGCTX_CACHE") or Path.home() / ".cache" / "longctx"
    return Path(root).expanduser()


@contextlib.contextmanager
def cache_lock(cache_dir, name: str) -> Iterator[Path]:
    """Holds ``cache_root/name``'s lock (DDP ranks preparing it at once prepare it once);
    yields the folder."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield root / name


def written_once(
    cache_dir, name: str, write: Callable[[Path], None], check: Callable[[Path], None]
) -> Path:
    """``cache_root/name``, written by ``write`` unless its manifest is there, then ``check``ed
    (it holds what its name stands for), all under the folder's lock."""
    with cache_lock(cache_dir, name) as out:
        for stale in out.parent.glob(f".{name}.*.partial"):  # a write killed midway: under
            shutil.rmtree(stale, ignore_errors=True)  # this lock, no live one is writing it
        if not (out / MANIFEST_NAME).is_file():
            write(out)
        check(out)
    return out
