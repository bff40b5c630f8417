"""Input files of `prepare`: which files, what each document's source id is, and which task
reads it.

Inputs are plain-text files (one document per file), JSONL (a ``text`` field, optional ``id``)
and Parquet (a ``text`` column, optional ``id``). A document's source id is its ``id`` field,
or the file's sha256 plus its line (JSONL) or row (Parquet) number; the validation split is a
hash of it, so the split does not depend on how the work is divided.

Work is divided by position in the inputs laid end to end (sorted file order, bytes): task k
of N owns the units (a text file, a JSONL line, a Parquet row group) that start in its
``[ceil(k*T/N), ceil((k+1)*T/N))`` of the T bytes. Owners grow with position, so the tasks'
outputs, laid end to end in task order, are the documents in input order, whatever N is.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from longctx.errors import LongctxError

_HASH_BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Source:
    """One input file as the manifest records it."""

    path: str
    sha256: str
    bytes: int
    format: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        raise LongctxError("no inputs given; expected text, .jsonl or .parquet files")
    return sorted(files)


def describe_source(path: Path) -> Source:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    format = {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix.lower(), "text")
    return Source(str(path), digest.hexdigest(), path.stat().st_size, format)


def is_validation(source_id: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(source id) as a fraction of 2**64."""
    if val_fraction <= 0.0:
        return False
    digest = hashlib.sha256(source_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2.0**64


def task_range(sources: Sequence[Source], task: int, tasks: int) -> tuple[int, int]:
    """[lo, hi) of the inputs' concatenated bytes that task ``task`` of ``tasks`` owns."""
    total = sum(s.bytes for s in sources)
    start = lambda k: -(-k * total // tasks)  # noqa: E731  ceil(k * total / tasks)
    return start(task), (start(task + 1) if task < tasks - 1 else total + 1)


def documents_of_task(
    sources: Sequence[Source], task: int, tasks: int
) -> Iterator[tuple[str, str]]:
    """(source id, text) of every document task ``task`` owns, in input order."""
    lo, hi = task_range(sources, task, tasks)
    offset = 0
    for source in sources:
        a, b = lo - offset, hi - offset  # the task's range, in this file's bytes
        empty_owned = source.bytes == 0 and a <= 0  # an empty file's one unit sits at byte 0
        if b > 0 and (a < source.bytes or empty_owned):
            yield from read_documents(source, max(a, 0), b)
        offset += source.bytes


def read_documents(source: Source, start: int = 0, end: int | None = None):
    """Documents of one file whose unit starts in bytes [start, end), in file order."""
    end = source.bytes + 1 if end is None else end
    path = Path(source.path)
    if source.format == "text":
        if start == 0:
            yield source.sha256, decode_text(path.read_bytes(), str(path))
    elif source.format == "jsonl":
        yield from _read_jsonl(path, source.sha256, start, end)
    else:
        yield from _read_parquet(path, source.sha256, start, end)


def decode_text(data: bytes, where: str) -> str:
    """UTF-8 text or a LongctxError naming ``where`` (a binary file is refused, not tokenised)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LongctxError(
            f"{where} is not UTF-8 text (invalid byte 0x{data[err.start]:02x} at offset "
            f"{err.start}); expected UTF-8 text, .jsonl or .parquet input"
        ) from err
    if "\0" in text:
        raise LongctxError(
            f"{where} holds NUL bytes (offset {text.index(chr(0))}): a binary file, not text; "
            "expected UTF-8 text, .jsonl or .parquet input"
        )
    return text


def _read_jsonl(path: Path, sha256: str, start: int, end: int) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:  # bytes: line numbers are the real ones (only \n ends a line)
        line_no, pos = _seek_line(f, start)
        for raw in f:
            if pos >= end:
                return
            line_no, pos = line_no + 1, pos + len(raw)
            try:  # the fast path; decode_text says what is wrong, and where
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                decode_text(raw, f"{path}:{line_no}")
            if "\0" in line:
                decode_text(raw, f"{path}:{line_no}")
            if line.strip():
                yield _jsonl_record(line, path, line_no, sha256)


def _seek_line(f, start: int) -> tuple[int, int]:
    """Position ``f`` at the first line starting at or after byte ``start``; returns (lines
    before it, its byte offset). Counting the newlines before it gives real line numbers."""
    if start == 0:
        return 0, 0
    lines, pos = 0, 0
    while pos < start - 1:  # count newlines in [0, start - 1)
        block = f.read(min(_HASH_BLOCK, start - 1 - pos))
        if not block:
            break
        lines, pos = lines + block.count(b"\n"), pos + len(block)
    if f.read(1) == b"\n":  # the byte before start ends a line: a line starts at start
        return lines + 1, start
    rest = f.readline()  # inside a line that an earlier task owns: skip to its end
    return lines + 1, start + len(rest)


def _jsonl_record(line: str, path: Path, line_no: int, sha256: str) -> tuple[str, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise LongctxError(
            f"{path}:{line_no} is not valid JSON ({err.msg} at column {err.colno}); "
            'expected one object per line, {"text": "...", "id": optional}'
        ) from err
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise LongctxError(
            f"{path}:{line_no} has no string 'text' field; expected "
            '{"text": "...", "id": optional}'
        )
    return str(record.get("id", f"{sha256[:16]}:{line_no}")), record["text"]


def _read_parquet(path: Path, sha256: str, start: int, end: int) -> Iterator[tuple[str, str]]:
    """Row group g's position is g/G of the file's bytes: a task owns whole row groups."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise LongctxError(f"{path} has columns {names}; expected a 'text' column")
    kind = parquet.schema_arrow.field("text").type
    if not _is_string_type(kind):
        raise LongctxError(f"{path}: column 'text' has type {kind}; expected a string column")
    columns = ["text"] + (["id"] if "id" in names else [])
    groups, size = parquet.metadata.num_row_groups, path.stat().st_size
    row = 0
    for g in range(groups):
        rows = parquet.metadata.row_group(g).num_rows
        if start <= g * size // groups < end:
            table = parquet.read_row_group(g, columns=columns)
            yield from _parquet_rows(table, columns, path, sha256, row)
        row += rows


def _is_string_type(kind) -> bool:
    import pyarrow as pa

    string_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or string_view(kind)


def _parquet_rows(table, columns, path, sha256, first_row) -> Iterator[tuple[str, str]]:
    texts = table.column("text").to_pylist()
    ids = table.column("id").to_pylist() if "id" in columns else [None] * len(texts)
    for row, (text, doc_id) in enumerate(zip(texts, ids, strict=True), first_row):
        if text is None:
            raise LongctxError(f"{path} row {row} has a null 'text'")
        yield (str(doc_id) if doc_id is not None else f"{sha256[:16]}:{row}"), text
