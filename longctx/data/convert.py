"""Convert corpora that other tools tokenised into a longctx prepared folder, without
re-tokenising.

    python -m longctx.data.convert SRC --out DIR --tokenizer FOLDER
    python -m longctx.data.convert SRC --out DIR --vocab-size V --eos-id E [--pad-id P]

SRC is one of (``--format`` names it when the path does not):

- ``megatron``: a Megatron indexed dataset (MMapIndexedDataset, index version 1): the path
  prefix, or its ``.bin`` or ``.idx`` file. A document is its sequences laid end to end.
- ``datatrove``: datatrove's tokenised output (what nanotron reads): a ``.ds`` file or a folder
  of them, each with its ``.ds.index`` (document ends) and ``.ds.metadata`` (token size, count).
- ``hf``: a Hugging Face ``datasets`` folder written by ``save_to_disk``, one document per row
  of its ``input_ids`` column (``--split`` picks one split of a DatasetDict).

Tokens are copied as they are (no EOS is added) and every document keeps its boundaries, so
document masking works. A source without boundaries (a ``.ds`` without its ``.index``) is
refused unless ``--document-length L`` declares fixed-length documents. The copy is checked:
each split's sha256 over (document length, tokens) is computed from the source as it is read
and again from the written shards before the manifest commits them. The validation split is a
hash of (source sha256, document number), as in ``prepare``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from longctx.cli import bar, command
from longctx.data.prepare import (
    DEFAULT_SHARD_TOKENS,
    claim_output_folder,
    commit,
    print_written,
)
from longctx.data.shards import (
    FORMAT_VERSION,
    SPLITS,
    Manifest,
    Vocabulary,
    task_writers,
    token_dtype,
)
from longctx.data.sources import describe_source, is_validation
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import LongctxError

FORMATS = ("megatron", "datatrove", "hf")
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py); floats are not tokens
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


@dataclasses.dataclass
class TokenSource:
    """A tokenised corpus: its files (hashed for the no-op rerun), its documents in order, and
    the token count it declares (checked against what was read), when it declares one."""

    format: str
    files: list[Path]
    documents: Callable[[], Iterator[np.ndarray]]
    declared_tokens: int | None = None


def convert(
    src: str | Path,
    out_dir: str | Path,
    vocab: Vocabulary,
    *,
    format: str | None = None,
    document_length: int | None = None,
    split: str | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
) -> Manifest:
    """Convert ``src`` into a prepared folder ``out_dir``; returns its manifest."""
    if not 0.0 <= val_fraction < 1.0:
        raise LongctxError(f"val_fraction={val_fraction}; expected 0 <= val_fraction < 1")
    source = open_source(Path(src), format, document_length, split)
    described = [describe_source(f) for f in source.files]
    key = [[d.sha256 for d in described], source.format, vocab.spec, vocab.eos_id, vocab.pad_id]
    key += [document_length, split, val_fraction, shard_tokens, FORMAT_VERSION]
    input_hash = hashlib.sha256(json.dumps(key).encode()).hexdigest()
    out = Path(out_dir)
    existing = claim_output_folder(out, input_hash, overwrite)
    if existing is not None:
        return existing
    splits, digests, skipped = _copy(
        source, out, vocab, described[0].sha256, val_fraction, shard_tokens
    )
    for name, info in splits.items():
        _check_written(out, name, info, digests[name])
    sources = [dict(d.to_dict(), format=source.format) for d in described]
    sources[0]["tokens_sha256"] = {name: d.hexdigest() for name, d in digests.items()}
    manifest = Manifest.of(input_hash, vocab, splits, sources, val_fraction, skipped)
    commit(out, manifest, ", ".join(str(f) for f in source.files))
    return manifest


def _copy(source, out, vocab, source_sha, val_fraction, shard_tokens):
    """Documents into two split writers; per split, a digest of what was read."""
    writers = task_writers(out, 0, token_dtype(vocab.vocab_size), shard_tokens)
    digests = {s: hashlib.sha256() for s in SPLITS}
    skipped = read = 0
    progress = bar(source.declared_tokens, "convert", unit="tok")
    for number, doc in enumerate(source.documents()):
        read += len(doc)
        progress.update(len(doc))
        if len(doc) == 0:
            skipped += 1
            continue
        _check_ids(doc, vocab.vocab_size, source, number)
        name = "val" if is_validation(f"{source_sha[:16]}:{number}", val_fraction) else "train"
        _digest(digests[name], doc)
        writers[name].add(doc)
    if source.declared_tokens is not None and read != source.declared_tokens:
        raise LongctxError(
            f"{source.files[0]}: the source declares {source.declared_tokens} tokens, its "
            f"documents hold {read}; the index disagrees with the token file"
        )
    progress.close()
    return {name: w.close() for name, w in writers.items()}, digests, skipped


def _check_ids(doc: np.ndarray, vocab_size: int, source: TokenSource, number: int) -> None:
    low, high = int(doc.min()), int(doc.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise LongctxError(
            f"{source.files[0]}: document {number} holds token id {bad}, outside the stated "
            f"vocabulary [0, {vocab_size}); expected --vocab-size / --tokenizer to cover the ids"
        )


def _digest(digest, doc: np.ndarray) -> None:
    digest.update(struct.pack("<Q", len(doc)))
    digest.update(np.ascontiguousarray(doc, dtype="<u4").tobytes())


def _check_written(out: Path, name: str, info, expected) -> None:
    """Read the shards back from disk: their digest must be the source's."""
    digest = hashlib.sha256()
    for shard in info.shards:
        tokens = np.load(out / shard.tokens_file, mmap_mode="r")
        offsets = np.load(out / shard.index_file)
        for a, b in zip(offsets[:-1], offsets[1:], strict=True):
            _digest(digest, tokens[a:b])
    if digest.hexdigest() != expected.hexdigest():
        raise RuntimeError(
            f"{out}: the {name} shards' token checksum {digest.hexdigest()[:16]} differs from "
            f"the source's {expected.hexdigest()[:16]}; the copy is corrupt (disk full?)"
        )


def open_source(
    src: Path, format: str | None, document_length: int | None, split: str | None
) -> TokenSource:
    format = format or detect_format(src)
    if format not in FORMATS:
        raise LongctxError(f"--format {format!r}; expected one of {FORMATS}")
    if document_length is not None and document_length < 1:
        raise LongctxError(f"--document-length {document_length}; expected >= 1")
    if format == "megatron":
        return megatron_source(src)
    if format == "datatrove":
        return datatrove_source(src, document_length)
    return hf_source(src, split)


def detect_format(src: Path) -> str:
    if src.suffix in (".bin", ".idx") or Path(f"{src}.idx").is_file():
        return "megatron"
    if src.suffix == ".ds" or (src.is_dir() and any(src.glob("*.ds"))):
        return "datatrove"
    if src.is_dir() and ((src / "state.json").is_file() or (src / "dataset_dict.json").is_file()):
        return "hf"
    raise LongctxError(
        f"{src}: not a Megatron prefix/.bin/.idx, a datatrove .ds file or folder, or a "
        f"datasets save_to_disk folder; expected one of them, or --format {FORMATS}"
    )


@dataclasses.dataclass
class MegatronIndex:
    dtype: np.dtype
    sizes: np.ndarray  # int32 [sequences]: tokens per sequence
    pointers: np.ndarray  # int64 [sequences]: byte offset of each sequence in the .bin
    doc_idx: np.ndarray  # int64 [documents + 1]: document d is sequences [doc_idx[d], doc_idx[d+1])


def read_megatron_index(path: Path) -> MegatronIndex:
    """Parse an MMapIndexedDataset .idx: header, version 1, dtype code, counts, then sizes,
    pointers and document indices (and, in multimodal indexes, one mode byte per sequence)."""
    with open(path, "rb") as f:
        data = f.read(34)
    if data[:9] != MEGATRON_HEADER:
        raise LongctxError(
            f"{path}: starts with {data[:9]!r}; expected {MEGATRON_HEADER!r} (a Megatron "
            "MMapIndexedDataset index)"
        )
    if len(data) < 34:
        raise LongctxError(f"{path}: {len(data)} bytes, shorter than the 34-byte header")
    (version,) = struct.unpack_from("<Q", data, 9)
    (code,) = struct.unpack_from("<B", data, 17)
    sequences, documents = struct.unpack_from("<QQ", data, 18)
    if version != 1:
        raise LongctxError(f"{path}: index version {version}; expected 1")
    if code not in MEGATRON_DTYPES:
        raise LongctxError(
            f"{path}: dtype code {code}; expected an integer code {sorted(MEGATRON_DTYPES)}"
        )
    size, actual = 34 + sequences * 12 + documents * 8, path.stat().st_size
    if actual not in (size, size + sequences):
        raise LongctxError(
            f"{path}: {actual} bytes, but its header ({sequences} sequences, {documents} "
            f"document indices) needs {size}; the index is truncated or corrupt"
        )

    def array(dtype: str, n: int, at: int) -> np.ndarray:  # mapped: an index can be GBs
        return np.memmap(path, dtype, "r", at, (n,)) if n else np.zeros(0, dtype)

    sizes = array("<i4", sequences, 34)
    pointers = array("<i8", sequences, 34 + sequences * 4)
    doc_idx = array("<i8", documents, 34 + sequences * 12)
    return MegatronIndex(np.dtype(MEGATRON_DTYPES[code]), sizes, pointers, doc_idx)


def megatron_source(src: Path) -> TokenSource:
    prefix = src.with_suffix("") if src.suffix in (".bin", ".idx") else src
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist; a Megatron dataset is a .bin and its .idx"
            )
    index = read_megatron_index(idx_path)
    _check_megatron(index, idx_path, bin_path)

    def documents() -> Iterator[np.ndarray]:
        tokens = np.memmap(bin_path, dtype=index.dtype, mode="r")
        # sequence s starts at token starts[s] (checked contiguous); one more entry: the end
        starts = np.append(index.pointers // index.dtype.itemsize, len(tokens))
        for first, last in zip(index.doc_idx[:-1], index.doc_idx[1:], strict=True):
            yield np.asarray(tokens[starts[first] : starts[last]])

    return TokenSource("megatron", [idx_path, bin_path], documents, int(index.sizes.sum()))


def _check_megatron(index: MegatronIndex, idx_path: Path, bin_path: Path) -> None:
    """The index must describe the token file exactly: contiguous sequences that fill it."""
    itemsize = index.dtype.itemsize
    expected = np.zeros(len(index.sizes), np.int64)
    np.cumsum(index.sizes[:-1].astype(np.int64) * itemsize, out=expected[1:])
    total = int(index.sizes.astype(np.int64).sum()) * itemsize
    bad = np.flatnonzero(index.pointers != expected)
    if (index.sizes < 0).any() or len(bad):
        where = int(bad[0]) if len(bad) else int(np.flatnonzero(index.sizes < 0)[0])
        raise LongctxError(
            f"{idx_path}: sequence {where} has pointer {int(index.pointers[where])} and size "
            f"{int(index.sizes[where])}, expected pointer {int(expected[where])}; the index "
            f"disagrees with its token file {bin_path}"
        )
    if bin_path.stat().st_size != total:
        raise LongctxError(
            f"{idx_path}: its sequences hold {total} bytes of {index.dtype.name}, but "
            f"{bin_path} has {bin_path.stat().st_size}; the index disagrees with its token file"
        )
    d = index.doc_idx
    if len(d) < 1 or d[0] != 0 or d[-1] != len(index.sizes) or (np.diff(d) < 0).any():
        raise LongctxError(
            f"{idx_path}: document indices {d[:3].tolist()}...{d[-3:].tolist()} do not rise "
            f"from 0 to the sequence count {len(index.sizes)}; the index is corrupt"
        )


def datatrove_source(src: Path, document_length: int | None) -> TokenSource:
    files = sorted(src.glob("*.ds")) if src.is_dir() else [src]
    if not files:
        raise FileNotFoundError(f"{src} holds no .ds files; expected datatrove tokenised output")
    token_sizes, declared, listed = [], 0, []
    for ds in files:
        size, count = _datatrove_metadata(ds)
        if ds.stat().st_size != count * size:
            raise LongctxError(
                f"{ds}: {ds.stat().st_size} bytes, but {ds}.metadata says {count} tokens of "
                f"{size} bytes; the token file is truncated or not this metadata's"
            )
        index = Path(f"{ds}.index")
        if not index.is_file() and document_length is None:
            raise LongctxError(
                f"{ds}: no {index.name}, so no document boundaries (document masking needs "
                "them); pass --document-length L to declare fixed-length documents of L tokens"
            )
        token_sizes.append(size)
        declared += count
        listed += [ds, Path(f"{ds}.metadata")] + ([index] if index.is_file() else [])

    def documents() -> Iterator[np.ndarray]:
        for ds, size in zip(files, token_sizes, strict=True):
            tokens = np.memmap(ds, dtype="<u2" if size == 2 else "<u4", mode="r")
            for a, b in _datatrove_bounds(ds, len(tokens), document_length):
                yield np.asarray(tokens[a:b])

    return TokenSource("datatrove", listed, documents, declared)


def _datatrove_metadata(ds: Path) -> tuple[int, int]:
    """(token size in bytes, token count) from ``<file>.ds.metadata``: 'tokenizer|size', count."""
    path = Path(f"{ds}.metadata")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; it gives the token size (2 or 4 bytes) and count of {ds}"
        )
    lines = path.read_text().splitlines()
    try:
        size, count = int(lines[0].rsplit("|", 1)[1]), int(lines[1])
    except (IndexError, ValueError) as err:
        raise LongctxError(
            f"{path}: {lines[:2]}; expected 'tokenizer|token size' and a count"
        ) from err
    if size not in (2, 4):
        raise LongctxError(f"{path}: token size {size}; expected 2 or 4 bytes")
    return size, count


def _datatrove_bounds(ds: Path, tokens: int, document_length: int | None):
    index = Path(f"{ds}.index")
    if not index.is_file():
        starts = np.arange(0, tokens, document_length)
        return zip(starts, np.minimum(starts + document_length, tokens), strict=True)
    ends = np.fromfile(index, dtype="<u8").astype(np.int64)
    if len(ends) and ((np.diff(ends) < 0).any() or ends[0] < 0 or ends[-1] != tokens):
        raise LongctxError(
            f"{index}: document ends {ends[:3].tolist()}...{ends[-3:].tolist()} do not rise "
            f"to the {tokens} tokens of {ds}; the index disagrees with its token file"
        )
    if not len(ends) and tokens:
        raise LongctxError(f"{index} is empty but {ds} holds {tokens} tokens; the index disagrees")
    return zip(np.concatenate([[0], ends[:-1]]), ends, strict=True)


def hf_source(src: Path, split: str | None) -> TokenSource:
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(src))
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise LongctxError(
                f"{src} is a DatasetDict with splits {sorted(dataset)}; pass --split NAME"
            )
        dataset = dataset[split]
    elif split is not None:
        raise LongctxError(f"--split {split!r}, but {src} is a single Dataset (no splits)")
    if "input_ids" not in dataset.column_names:
        raise LongctxError(
            f"{src} has columns {dataset.column_names}; expected an 'input_ids' column"
        )
    files = [Path(f["filename"]) for f in dataset.cache_files]

    def documents() -> Iterator[np.ndarray]:
        for batch in dataset.with_format("arrow").iter(batch_size=4096):
            column = batch.column("input_ids").combine_chunks()
            if column.null_count:
                raise LongctxError(f"{src}: a row of 'input_ids' is null; expected a token list")
            offsets = column.offsets.to_numpy()
            values = column.values.to_numpy(zero_copy_only=False)
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                yield values[a:b]

    return TokenSource("hf", files, documents)


def vocabulary(
    tokenizer: str | None, vocab_size: int | None, eos_id: int | None, pad_id: int | None, name: str
) -> Vocabulary:
    """From a local tokenizer folder (what eval decodes with), or stated ids."""
    if tokenizer is not None:
        if vocab_size is not None or eos_id is not None:
            raise LongctxError("--tokenizer gives the vocabulary; drop --vocab-size / --eos-id")
        tok = load_tokenizer(tokenizer)
        return Vocabulary(int(tok.vocab_size), int(tok.eos_id), int(tok.pad_id), tok.spec)
    if vocab_size is None or eos_id is None:
        raise LongctxError("expected --tokenizer FOLDER, or both --vocab-size and --eos-id")
    pad_id = eos_id if pad_id is None else pad_id
    for what, value in (("eos-id", eos_id), ("pad-id", pad_id)):
        if not 0 <= value < vocab_size:
            raise LongctxError(f"--{what} {value}; expected 0 <= id < --vocab-size {vocab_size}")
    spec = {"kind": "external", "name": name, "vocab_size": vocab_size}
    return Vocabulary(vocab_size, eos_id, pad_id, spec)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m longctx.data.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="Megatron prefix/.bin/.idx, datatrove .ds or folder, HF folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from SRC")
    parser.add_argument("--tokenizer", help="'llama3' or the source's tokenizer folder")
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--eos-id", type=int)
    parser.add_argument("--pad-id", type=int, help="default: --eos-id")
    parser.add_argument("--tokenizer-name", default="unknown", help="recorded with --vocab-size")
    parser.add_argument(
        "--document-length", type=int, help="fixed length, for sources without boundaries"
    )
    parser.add_argument("--split", help="the split of a DatasetDict")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    vocab = vocabulary(
        args.tokenizer, args.vocab_size, args.eos_id, args.pad_id, args.tokenizer_name
    )
    manifest = convert(
        args.src,
        args.out,
        vocab,
        format=args.format,
        document_length=args.document_length,
        split=args.split,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    print_written(manifest, args.out)


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
