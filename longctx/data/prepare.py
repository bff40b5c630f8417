"""Tokenise text files into memory-mapped token shards plus a manifest.

    python -m longctx.data.prepare INPUT... --tokenizer byte|/path/to/tokenizer --out DIR

Inputs: plain-text files (one document per file; globs allowed), JSONL (a ``text`` field,
optional ``id``) and Parquet (a ``text`` column, optional ``id``). Documents are tokenised in
worker processes; ``imap`` keeps the output order deterministic. Every document gets EOS.
A document goes to the validation split when the hash of its source id (its ``id`` field, or
the source file's sha256 plus its position in that file) falls below ``val_fraction``.

Re-running with the same inputs, tokenizer and options is a no-op (the manifest's input hash
matches and its shards are intact). Shards are written under temp names and renamed; the
manifest is written last, so an interrupted run leaves no manifest and the next run redoes it.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import multiprocessing as mp
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from longctx.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PREPARED_MARKER,
    Manifest,
    ShardInfo,
    SplitInfo,
    atomic_save_npy,
    atomic_write_bytes,
    load_manifest,
    remove_temp_files,
    shard_files_intact,
    write_manifest,
)
from longctx.data.tokenizer import Tokenizer, load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
_CHUNK_BYTES = 1 << 20  # text per worker task: large enough to amortise IPC
_HASH_BLOCK = 1 << 20


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path | Tokenizer = "byte",
    *,
    workers: int | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    """Prepare ``inputs`` into ``out_dir``; returns the (new or already present) manifest."""
    _check_options(val_fraction, shard_tokens, workers)
    out = Path(out_dir)
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    sources = [_describe_source(path) for path in files]
    input_hash = _input_hash(sources, tok.spec, val_fraction, shard_tokens)
    existing = _existing_manifest(out, input_hash, overwrite)
    if existing is not None:
        return existing
    claim_output_folder(out)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # the old commit point goes first
    remove_temp_files(out)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    writers = {s: _SplitWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
    skipped = _tokenize_all(files, sources, tok, val_fraction, writers, workers, progress)
    splits = {name: w.close() for name, w in writers.items()}
    if splits["train"].documents + splits["val"].documents == 0:
        raise ValueError(f"inputs {[str(f) for f in files]} hold no non-empty documents")
    manifest = Manifest(
        input_hash=input_hash,
        tokenizer=tok.spec,
        vocab_size=int(tok.vocab_size),
        eos_id=int(tok.eos_id),
        pad_id=int(tok.pad_id),
        dtype=np.dtype(dtype).name,
        val_fraction=val_fraction,
        sources=sources,
        splits=splits,
        skipped_empty_documents=skipped,
    )
    write_manifest(out, manifest)
    return manifest


def _check_options(val_fraction: float, shard_tokens: int, workers: int | None) -> None:
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}; expected 0 <= val_fraction < 1")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens={shard_tokens}; expected >= 1")
    if workers is not None and workers < 1:
        raise ValueError(f"workers={workers}; expected >= 1 (or None for all CPUs)")


def _existing_manifest(out: Path, input_hash: str, overwrite: bool) -> Manifest | None:
    """The manifest already in ``out`` when it is this exact preparation and intact."""
    if not (out / MANIFEST_NAME).is_file():
        return None
    manifest = load_manifest(out)
    if manifest.input_hash == input_hash and shard_files_intact(out, manifest):
        return manifest
    if manifest.input_hash != input_hash and not overwrite:
        raise FileExistsError(
            f"{out} holds a corpus prepared from other inputs or options (input hash "
            f"{manifest.input_hash[:12]}, this run {input_hash[:12]}); choose another output "
            "folder or pass overwrite=True / --overwrite"
        )
    return None


def claim_output_folder(out: Path) -> None:
    """Create ``out`` and mark it ours; refuse a non-empty folder that prepare did not make.

    The marker is written before any shard, so an interrupted run's folder is still ours.
    """
    marked = (out / PREPARED_MARKER).is_file() or (out / MANIFEST_NAME).is_file()
    if out.is_dir() and not marked and any(out.iterdir()):
        raise FileExistsError(
            f"--out {out} is a non-empty folder that holds no prepared corpus (no "
            f"{MANIFEST_NAME} or {PREPARED_MARKER}); expected a new or empty folder, so "
            "prepare never writes among (or deletes) files that are not its own"
        )
    out.mkdir(parents=True, exist_ok=True)
    if not (out / PREPARED_MARKER).is_file():
        atomic_write_bytes(out / PREPARED_MARKER, b"written by python -m longctx.data.prepare\n")


# --------------------------------------------------------------------------- inputs
def expand_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Files named by paths or globs, sorted and deduplicated; a pattern matching nothing errs."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    files: set[Path] = set()
    for item in inputs:
        matches = sorted(glob.glob(str(item), recursive=True))
        matches = [m for m in matches if Path(m).is_file()]
        if not matches:
            raise FileNotFoundError(f"input {str(item)!r} matches no file")
        files.update(Path(m).resolve() for m in matches)
    if not files:
        raise ValueError("no inputs given; expected text, .jsonl or .parquet files")
    return sorted(files)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def _describe_source(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return {
        "path": str(path),
        "sha256": digest.hexdigest(),
        "bytes": path.stat().st_size,
        "format": _format_of(path),
    }


def _input_hash(sources: list[dict], spec: dict, val_fraction: float, shard_tokens: int) -> str:
    key = {
        "sources": [(s["sha256"], s["format"]) for s in sources],
        "tokenizer": spec,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "format_version": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def read_documents(path: Path, sha256: str) -> Iterator[tuple[str, str]]:
    """(source id, text) of every document in one input file, in file order."""
    kind = _format_of(path)
    if kind == "text":
        yield sha256, _decode_text(path.read_bytes(), str(path))
    elif kind == "jsonl":
        yield from _read_jsonl(path, sha256)
    else:
        yield from _read_parquet(path, sha256)


def _decode_text(data: bytes, where: str) -> str:
    """UTF-8 text or a ValueError naming ``where`` (a binary file is refused, not tokenised)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where} is not UTF-8 text (invalid byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); expected UTF-8 text, .jsonl or .parquet input"
        ) from err
    if "\0" in text:
        raise ValueError(
            f"{where} holds NUL bytes (offset {text.index(chr(0))}): a binary file, not text; "
            "expected UTF-8 text, .jsonl or .parquet input"
        )
    return text


def _read_jsonl(path: Path, sha256: str) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:  # bytes: line numbers are the real ones (only \n ends a line)
        for line_no, raw in enumerate(f, 1):
            line = _decode_text(raw, f"{path}:{line_no}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{line_no} is not valid JSON ({err.msg} at column {err.colno}); "
                    'expected one object per line, {"text": "...", "id": optional}'
                ) from err
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f"{path}:{line_no} has no string 'text' field; expected "
                    '{"text": "...", "id": optional}'
                )
            yield str(record.get("id", f"{sha256[:16]}:{line_no}")), record["text"]


def _read_parquet(path: Path, sha256: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"{path} has columns {names}; expected a 'text' column")
    columns = ["text"] + (["id"] if "id" in names else [])
    row = 0
    for batch in parquet.iter_batches(columns=columns, batch_size=4096):
        texts = batch.column("text").to_pylist()
        ids = batch.column("id").to_pylist() if "id" in columns else [None] * len(texts)
        for text, doc_id in zip(texts, ids, strict=True):
            if text is None:
                raise ValueError(f"{path} row {row} has a null 'text'")
            yield (str(doc_id) if doc_id is not None else f"{sha256[:16]}:{row}"), text
            row += 1


def is_validation(source_id: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(source id) as a fraction of 2**64."""
    if val_fraction <= 0.0:
        return False
    digest = hashlib.sha256(source_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2.0**64


# --------------------------------------------------------------------------- tokenise
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _tokenize_chunk(task: tuple[list[tuple[str, str]], float]) -> tuple[list, int, int]:
    """Worker: tokenise a chunk; returns [(is_val, tokens with EOS)], skipped, text bytes."""
    documents, val_fraction = task
    tok = _WORKER_TOKENIZER
    out, skipped, nbytes = [], 0, 0
    for source_id, text in documents:
        nbytes += len(text.encode("utf-8"))
        ids = np.asarray(tok.encode(text), dtype=np.int64)
        if len(ids) == 0:
            skipped += 1
            continue
        if ids.min() < 0 or ids.max() >= tok.vocab_size:
            raise ValueError(
                f"document {source_id!r}: tokenizer returned id "
                f"{int(ids.max())} outside [0, {tok.vocab_size})"
            )
        out.append((is_validation(source_id, val_fraction), np.append(ids, tok.eos_id)))
    return out, skipped, nbytes


def _chunks(files: list[Path], sources: list[dict], val_fraction: float) -> Iterator[tuple]:
    chunk, size = [], 0
    for path, source in zip(files, sources, strict=True):
        for source_id, text in read_documents(path, source["sha256"]):
            chunk.append((source_id, text))
            size += len(text)
            if size >= _CHUNK_BYTES:
                yield chunk, val_fraction
                chunk, size = [], 0
    if chunk:
        yield chunk, val_fraction


def _tokenize_all(files, sources, tok, val_fraction, writers, workers, progress) -> int:
    workers = workers or os.cpu_count() or 1
    tasks = _chunks(files, sources, val_fraction)
    total = sum(s["bytes"] for s in sources)
    skipped = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenise", disable=not progress) as bar:
        for documents, chunk_skipped, nbytes in _map_ordered(tok, tasks, workers):
            for is_val, ids in documents:
                writers["val" if is_val else "train"].add(ids)
            skipped += chunk_skipped
            bar.update(nbytes)
    return skipped


def _map_ordered(tok: Tokenizer, tasks: Iterator, workers: int) -> Iterator:
    if workers == 1:
        _init_worker(tok)
        yield from map(_tokenize_chunk, tasks)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok,)) as pool:
        yield from pool.imap(_tokenize_chunk, tasks, chunksize=1)


# --------------------------------------------------------------------------- write
class _SplitWriter:
    """Accumulates documents and writes a shard (tokens + offsets) every ``shard_tokens``."""

    def __init__(self, folder: Path, split: str, dtype, shard_tokens: int) -> None:
        self.folder, self.split, self.dtype = folder, split, dtype
        self.shard_tokens = shard_tokens
        self.info = SplitInfo()
        self._docs: list[np.ndarray] = []
        self._pending = 0

    def add(self, ids: np.ndarray) -> None:
        self._docs.append(ids.astype(self.dtype))
        self._pending += len(ids)
        if self._pending >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._docs:
            return
        stem = f"{self.split}-{len(self.info.shards):05d}"
        tokens = np.concatenate(self._docs)
        offsets = np.zeros(len(self._docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in self._docs], out=offsets[1:])
        atomic_save_npy(self.folder / f"{stem}.tokens.npy", tokens)
        atomic_save_npy(self.folder / f"{stem}.index.npy", offsets)
        self.info.shards.append(
            ShardInfo(
                tokens_file=f"{stem}.tokens.npy",
                index_file=f"{stem}.index.npy",
                documents=len(self._docs),
                tokens=len(tokens),
                tokens_bytes=(self.folder / f"{stem}.tokens.npy").stat().st_size,
                index_bytes=(self.folder / f"{stem}.index.npy").stat().st_size,
            )
        )
        self.info.documents += len(self._docs)
        self.info.tokens += len(tokens)
        self._docs, self._pending = [], 0

    def close(self) -> SplitInfo:
        self._flush()
        return self.info


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m longctx.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", help="text/.jsonl/.parquet files or globs")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a local tokenizer folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: CPUs)")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    manifest = prepare(
        args.inputs,
        args.out,
        args.tokenizer,
        workers=args.workers,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    for name, split in manifest.splits.items():
        print(
            f"{name}: {split.documents} documents, {split.tokens} tokens, "
            f"{len(split.shards)} shards ({manifest.dtype})"
        )


if __name__ == "__main__":
    main()
