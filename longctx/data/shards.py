"""The prepared corpus on disk: manifest, shard writer, and a validating shard reader.

Layout of a prepared folder::

    manifest.json                 written last, atomically: the commit point
    train-00000-00000.tokens.npy  uint16/uint32 tokens of consecutive documents (each ends in
                                  EOS); named train-<task>-<n>: each prepare task writes its own
    train-00000-00000.index.npy   int64 offsets [documents + 1] into the tokens file
    val-00000-00000.tokens.npy    the held-out split, same format
    .longctx-prepare              marks the folder as prepare's (written before any shard)
    .longctx-work/                the tasks' results and logs (datatrove's logging folder)

A reader trusts only shards listed in a complete manifest whose files have the listed sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from longctx.errors import LongctxError
from longctx.io import atomic_file, atomic_write_bytes, remove_temp_files

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "val")
# written first into a prepare output folder: the folder is ours even before its manifest exists
PREPARED_MARKER = ".longctx-prepare"


class ManifestError(LongctxError):
    """A manifest that cannot be read: its path and the offending key are in the message."""


@dataclasses.dataclass
class Vocabulary:
    """The ids a corpus's tokens mean: what its manifest records of its tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int
    spec: dict


def token_dtype(vocab_size: int) -> str:
    """uint16 shards while every id fits; ids past 65535 need uint32 (uint16 wraps silently)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32).name


def settings_digest(settings) -> str:
    """sha256 of ``settings`` as sorted JSON: the same settings always give the same digest."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class ShardInfo:
    tokens_file: str
    index_file: str
    documents: int
    tokens: int
    tokens_bytes: int
    index_bytes: int


@dataclasses.dataclass
class SplitInfo:
    documents: int = 0
    tokens: int = 0
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Manifest:
    input_hash: str
    tokenizer: dict
    vocab_size: int
    eos_id: int
    pad_id: int
    dtype: str
    val_fraction: float
    sources: list[dict]
    splits: dict[str, SplitInfo]
    skipped_empty_documents: int = 0
    format_version: int = FORMAT_VERSION

    @classmethod
    def of(
        cls,
        input_hash: str,
        vocab: Vocabulary,
        splits: dict[str, SplitInfo],
        sources: list[dict],
        val_fraction: float = 0.0,
        skipped_empty_documents: int = 0,
    ) -> Manifest:
        """``vocab``: a Vocabulary or a tokenizer (they name the same four attributes)."""
        return cls(
            input_hash=input_hash,
            tokenizer=vocab.spec,
            vocab_size=int(vocab.vocab_size),
            eos_id=int(vocab.eos_id),
            pad_id=int(vocab.pad_id),
            dtype=token_dtype(vocab.vocab_size),
            val_fraction=val_fraction,
            sources=sources,
            splits=splits,
            skipped_empty_documents=skipped_empty_documents,
        )

    @classmethod
    def from_dict(cls, data: dict, where: str = "manifest") -> Manifest:
        """Build from parsed JSON; a missing, unknown or mistyped key raises ManifestError
        naming ``where`` and the key's path (``splits.train.shards[3].tokens``)."""
        _check_keys(data, cls, where, "")
        return cls(**dict(data, splits=splits_from_dict(data["splits"], where)))


# by the annotation's outer type: splits (dict[str, SplitInfo]) and shards (list[...]) too
_FIELD_TYPES = {"int": int, "str": str, "dict": dict, "float": (int, float), "list": list}


def _check_keys(data, cls, where: str, prefix: str) -> None:
    if not isinstance(data, dict):
        raise ManifestError(
            f"{where}: {prefix or 'top level'} is {type(data).__name__}; expected an object"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in required:
        if name not in data:
            raise ManifestError(
                f"{where}: key '{prefix}{name}' is missing; the manifest is truncated or edited, prepare the corpus again"
            )
    for name, value in data.items():
        if name not in fields:
            raise ManifestError(f"{where}: unknown key '{prefix}{name}'; expected {sorted(fields)}")
        wanted = _FIELD_TYPES.get(str(fields[name].type).split("[")[0])
        if wanted is not None and (not isinstance(value, wanted) or isinstance(value, bool)):
            raise ManifestError(
                f"{where}: key {prefix}{name} = {value!r}; expected {fields[name].type}"
            )


def splits_from_dict(splits: dict, where: str) -> dict[str, SplitInfo]:
    """A manifest's (or a task result's) ``splits``, each key checked as from_dict says."""
    infos = {}
    for name, split in splits.items():
        _check_keys(split, SplitInfo, where, f"splits.{name}.")
        for i, shard in enumerate(split["shards"]):
            _check_keys(shard, ShardInfo, where, f"splits.{name}.shards[{i}].")
        shards = [ShardInfo(**s) for s in split["shards"]]
        infos[name] = SplitInfo(split["documents"], split["tokens"], shards)
    return infos


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, array, allow_pickle=False)


def check_val_split(splits: dict[str, SplitInfo], val_fraction: float, where: str | Path) -> None:
    """A requested validation split that came out empty is refused (training would find no
    validation rows): a small corpus at the default 1% often draws none."""
    val, total = splits["val"].documents, splits["train"].documents + splits["val"].documents
    if val_fraction == 0 or val > 0:
        return
    raise LongctxError(
        f"{where}: --val-fraction {val_fraction} put 0 of its {total} documents in the "
        f"validation split; pass a larger --val-fraction (about {min(0.5, 3 / total):.2g} "
        "expects 3 of them), or --val-fraction 0 for no validation split"
    )


def write_manifest(folder: Path, manifest: Manifest) -> None:
    text = json.dumps(dataclasses.asdict(manifest), indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(Path(folder) / MANIFEST_NAME, text.encode())


def load_manifest(folder: str | Path) -> Manifest:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; expected a folder prepared by "
            "`python -m longctx.data.prepare` or written by `python -m longctx.data.synthesize` "
            "(an interrupted one leaves no manifest)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(
            f"{path} is not valid JSON ({err}); the manifest is truncated or edited, "
            "prepare the corpus again"
        ) from err
    manifest = Manifest.from_dict(data, where=str(path))
    if manifest.format_version != FORMAT_VERSION:
        raise LongctxError(
            f"{path} has format_version {manifest.format_version}, expected {FORMAT_VERSION}; "
            "prepare the corpus again"
        )
    return manifest


def shard_files_intact(folder: Path, manifest: Manifest) -> bool:
    """True when every listed shard file exists with the listed size."""
    for split in manifest.splits.values():
        for shard in split.shards:
            for name, size in (
                (shard.tokens_file, shard.tokens_bytes),
                (shard.index_file, shard.index_bytes),
            ):
                path = Path(folder) / name
                if not path.is_file() or path.stat().st_size != size:
                    return False
    return True


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A new folder beside ``out``, renamed to ``out`` (new or empty) when the block completes;
    removed, with the parent folders made for it, when the block raises."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # innermost first
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # as a plain mkdir would (mkdtemp makes it private)
    try:
        yield stage
        os.rename(stage, out)  # onto an empty folder too (POSIX)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for parent in made:
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def require_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LongctxError(
            f"--out is not a new or empty folder ({out}); choose another: a generated corpus "
            "is never written among other files"
        )


def write_generated(
    out: str | Path,
    options: dict,
    vocab: Vocabulary,
    write_splits: Callable[[Path, str], dict[str, SplitInfo]],
) -> Manifest:
    """A corpus generated as ``options`` say (its one recorded source; their digest is its input
    hash) into ``out``, new or empty, where it appears whole or not at all.
    ``write_splits(folder, dtype)`` writes the documents."""
    out = Path(out)
    require_new_folder(out)
    with staged_folder(out) as folder:
        splits = write_splits(folder, token_dtype(vocab.vocab_size))
        manifest = Manifest.of(settings_digest(options), vocab, splits, [options])
        write_manifest(folder, manifest)
    return manifest


def task_writers(folder: Path, task: int, dtype: str, shard_tokens: int) -> dict[str, SplitWriter]:
    """Task ``task``'s writer per split, once a killed attempt's leftovers (its own only) are
    gone."""
    writers = {}
    for split in SPLITS:
        stem = f"{split}-{task:05d}"
        remove_temp_files(folder, stem)
        writers[split] = SplitWriter(folder, stem, dtype, shard_tokens)
    return writers


class SplitWriter:
    """Accumulates documents and writes a shard (tokens + offsets) every ``shard_tokens``.

    Shards are named ``{stem}-{n:05d}``: each prepare task writes under its own stem.
    """

    def __init__(self, folder: Path, stem: str, dtype, shard_tokens: int) -> None:
        self.folder, self.stem, self.dtype = Path(folder), stem, dtype
        self.shard_tokens = shard_tokens
        self.info = SplitInfo()
        self._docs: list[np.ndarray] = []
        self._pending = 0

    def add(self, ids: np.ndarray) -> None:
        self._docs.append(np.asarray(ids, dtype=self.dtype))  # no copy when already that dtype
        self._pending += len(ids)
        if self._pending >= self.shard_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._docs:
            return
        name = f"{self.stem}-{len(self.info.shards):05d}"
        tokens = np.concatenate(self._docs)
        offsets = np.zeros(len(self._docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in self._docs], out=offsets[1:])
        atomic_save_npy(self.folder / f"{name}.tokens.npy", tokens)
        atomic_save_npy(self.folder / f"{name}.index.npy", offsets)
        self.info.shards.append(
            ShardInfo(
                tokens_file=f"{name}.tokens.npy",
                index_file=f"{name}.index.npy",
                documents=len(self._docs),
                tokens=len(tokens),
                tokens_bytes=(self.folder / f"{name}.tokens.npy").stat().st_size,
                index_bytes=(self.folder / f"{name}.index.npy").stat().st_size,
            )
        )
        self.info.documents += len(self._docs)
        self.info.tokens += len(tokens)
        self._docs, self._pending = [], 0

    def close(self) -> SplitInfo:
        self._flush()
        return self.info


class ShardSet:
    """The documents of one split of a prepared folder, memory-mapped and validated on open.

    Validation (all vectorised): each listed file exists with its listed size, offsets start
    at 0, never decrease and end at the token count, and every token id is < vocab_size.
    """

    def __init__(self, folder: str | Path, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split {split!r}; expected one of {SPLITS}")
        self.folder = Path(folder)
        self.split = split
        self.manifest = load_manifest(self.folder)
        info = self.manifest.splits[split]
        self._tokens = [self._open(s.tokens_file, s.tokens_bytes) for s in info.shards]
        self._offsets = [self._open(s.index_file, s.index_bytes) for s in info.shards]
        for shard, tokens, offsets in zip(info.shards, self._tokens, self._offsets, strict=True):
            self._validate(shard, tokens, offsets)
        counts = [len(o) - 1 for o in self._offsets]
        self._first_doc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_documents = int(self._first_doc[-1])
        self.num_tokens = int(sum(len(t) for t in self._tokens))

    def _open(self, name: str, size: int) -> np.ndarray:
        path = self.folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"shard file {path} is missing; {self.folder / MANIFEST_NAME} lists it"
            )
        if path.stat().st_size != size:
            raise LongctxError(
                f"shard file {path} has {path.stat().st_size} bytes, the manifest lists {size}; "
                "the folder is corrupt: prepare it again"
            )
        return np.load(path, mmap_mode="r", allow_pickle=False)

    def _validate(self, shard: ShardInfo, tokens: np.ndarray, offsets: np.ndarray) -> None:
        where = self.folder / shard.tokens_file
        if len(offsets) != shard.documents + 1 or len(tokens) != shard.tokens:
            raise LongctxError(
                f"{where}: {len(offsets) - 1} documents / {len(tokens)} tokens, "
                f"manifest lists {shard.documents} / {shard.tokens}"
            )
        if offsets[0] != 0 or offsets[-1] != len(tokens) or (np.diff(offsets) <= 0).any():
            raise LongctxError(
                f"{where}: document offsets are not increasing from 0 to "
                f"{len(tokens)}; the index is corrupt"
            )
        top = int(tokens.max()) if len(tokens) else -1
        if top >= self.manifest.vocab_size:
            raise LongctxError(
                f"{where} holds token id {top} >= vocab_size "
                f"{self.manifest.vocab_size} of its manifest; the shard is corrupt"
            )

    def document_lengths(self) -> np.ndarray:
        """int64 [documents]: tokens of every document (EOS included)."""
        if not self._offsets:
            return np.zeros(0, np.int64)
        return np.concatenate([np.diff(o) for o in self._offsets]).astype(np.int64)

    def __len__(self) -> int:
        return self.num_documents

    def document(self, i: int) -> np.ndarray:
        """Tokens of document i (ending in EOS), as int64."""
        shard = int(np.searchsorted(self._first_doc, i, side="right")) - 1
        local = i - int(self._first_doc[shard])
        offsets = self._offsets[shard]
        return np.asarray(self._tokens[shard][offsets[local] : offsets[local + 1]], np.int64)
