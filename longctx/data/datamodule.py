"""LongCtxDataModule: prepared shards -> packed rows -> PackedBatch, with exact resume.

How the document stream is cut (and why):

* Streams. Each rank runs ``S = streams_per_rank`` independent streams (default
  ``max(1, num_workers)``); global stream ``k = rank * S + s`` of ``N = world * S``. Per data
  epoch ``e`` a seeded permutation ``perm_e`` of a source's documents is drawn (numpy,
  ``seed, source, e``) and stream ``k`` takes ``perm_e[k::N]``: the streams of all ranks cover
  every document of the epoch exactly once. With several sources, each document slot of a
  stream picks its source from a seeded draw with the mixing weights; each source then cycles
  through its own epochs independently.
* Chunks. A stream's (endless) document sequence is cut into chunks of ``chunk_documents``
  documents, each packed by a fresh packer; rows flow on from chunk to chunk. A chunk is a
  multiple of the best-fit buffer, so chunking changes nothing but one padded row per chunk.
  The cursor of a stream is (chunk, rows already taken from it): resuming replays at most one
  chunk, never the whole history.
* Batches. Per rank, batch ``g`` (counted over the whole run) is batch ``g // S`` of stream
  ``g % S``. A DataLoader worker ``w`` of ``W`` produces batches ``g0 + w, g0 + w + W, ...``
  which the DataLoader's in-order round robin delivers as ``g0, g0 + 1, ...``. So the batch
  sequence does not depend on ``num_workers``, only on ``streams_per_rank``.
* Equal batches per rank. Streams never run dry (they go on into the next data epoch), and a
  Lightning epoch is a fixed ``batches_per_epoch = train tokens // (world * B * L)`` batches on
  every rank, so ranks always step together (no DDP hang). The last rows of a data epoch are
  packed together with the first documents of the next.
* Exact resume. The state is the number of batches the training loop consumed (counted in
  ``on_before_batch_transfer``, after Lightning's prefetch, so prefetched batches do not
  count) plus each stream's cursor after its last consumed batch; every rank's cursors are
  gathered into the checkpoint under DDP. The iterator reads the state when it starts, so a
  train dataloader built early (``trainer.estimated_stepping_batches``) loses nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from longctx.batch import PackedBatch
from longctx.data.corpus import default_corpus_dir
from longctx.data.shards import Manifest, ShardSet, load_manifest
from longctx.distributed.context import data_parallel_rank_and_size
from longctx.eval.baselines import unigram_cross_entropy
from longctx.packing import PackedRow, collate_rows, make_packer

_META = "_longctx_stream_meta"  # attribute a train batch carries: (g, stream, cursor after)
STATE_VERSION = 1


@dataclasses.dataclass
class DataConfig:
    shards: list[str] | None = None  # prepared folders; None -> the embedded default corpus
    weights: list[float] | None = None  # mixing weights, one per folder
    seq_len: int = 2048
    packer: str = "best_fit"  # "concat_chunk" | "best_fit"
    reset_position_ids: bool = True
    document_mask: bool = True  # False = one segment per row: the no-masking ablation
    micro_batch_size: int = 1
    seed: int = 0
    num_workers: int = 0
    pin_memory: bool = True  # effective only with CUDA
    buffer_size: int = 1000  # best_fit buffer (documents)
    val_rows: int = 16  # the fixed validation set: the first val_rows rows of the val split
    cache_dir: str | None = None
    streams_per_rank: int | None = None  # None -> max(1, num_workers); fixes the batch order
    chunk_documents: int = 10_000  # resume replays at most this many documents per stream

    def __post_init__(self) -> None:
        if isinstance(self.shards, str):  # data.shards=/one/folder: one source, not its letters
            self.shards = [self.shards]
        for name in ("seq_len", "micro_batch_size", "buffer_size", "val_rows", "chunk_documents"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(self.num_workers >= 0, "num_workers", self.num_workers, ">= 0")
        if self.streams_per_rank is not None:
            _require(self.streams_per_rank >= 1, "streams_per_rank", self.streams_per_rank, ">= 1")
        _require(
            self.packer in ("concat_chunk", "best_fit"),
            "packer",
            self.packer,
            "'concat_chunk' or 'best_fit'",
        )
        if self.packer == "best_fit":
            _require(
                self.chunk_documents % self.buffer_size == 0,
                "chunk_documents",
                self.chunk_documents,
                f"a multiple of buffer_size={self.buffer_size}",
            )
        if self.weights is not None:
            count = len(self.shards) if self.shards else 1
            _require(
                len(self.weights) == count,
                "weights",
                self.weights,
                f"{count} weights, one per shard folder",
            )
            _require(
                all(w >= 0 for w in self.weights) and sum(self.weights) > 0,
                "weights",
                self.weights,
                "non-negative weights with a positive sum",
            )

    @property
    def effective_streams(self) -> int:
        return self.streams_per_rank or max(1, self.num_workers)


def _require(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"DataConfig.{name}={value!r}; expected {expected}")


# --------------------------------------------------------------------------- document streams
class DocumentStream:
    """The endless document sequence of one global stream, as a pure function of its index."""

    def __init__(
        self,
        sources: list[ShardSet],
        weights: np.ndarray,
        seed: int,
        stream: int,
        num_streams: int,
        chunk_documents: int,
    ) -> None:
        self.sources, self.weights, self.seed = sources, weights, seed
        self.stream, self.num_streams, self.chunk = stream, num_streams, chunk_documents
        self.shares = [len(range(stream, len(s), num_streams)) for s in sources]
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self._counts = {0: np.zeros(len(sources), dtype=np.int64)}  # per-source docs before chunk

    def chunk_ids(self, chunk: int) -> list[tuple[int, int]]:
        """(source, document) of every document in ``chunk``, in order."""
        choice = self._choices(chunk)
        start = self._counts_before(chunk)
        out = []
        for i, count in enumerate(np.bincount(choice, minlength=len(self.sources))):
            locals_ = start[i] + np.arange(count)
            docs = self._local_to_doc(i, locals_)
            out.append(iter(docs.tolist()))
        return [(int(src), next(out[src])) for src in choice]

    def documents(self, chunk: int) -> Iterator[np.ndarray]:
        for source, doc in self.chunk_ids(chunk):
            yield self.sources[source].document(doc)

    def _choices(self, chunk: int) -> np.ndarray:
        if len(self.sources) == 1:
            return np.zeros(self.chunk, dtype=np.int64)
        rng = np.random.default_rng((self.seed, 1_000_003, self.stream, chunk))
        return rng.choice(len(self.sources), size=self.chunk, p=self.weights)

    def _counts_before(self, chunk: int) -> np.ndarray:
        known = max(c for c in self._counts if c <= chunk)
        counts = self._counts[known].copy()
        for c in range(known, chunk):
            counts += np.bincount(self._choices(c), minlength=len(self.sources))
        self._counts[chunk] = counts
        return counts

    def _local_to_doc(self, source: int, local: np.ndarray) -> np.ndarray:
        share = self.shares[source]
        epochs, positions = np.divmod(local, share)
        out = np.empty(len(local), dtype=np.int64)
        for epoch in np.unique(epochs):
            mine = self._permutation(source, int(epoch))[self.stream :: self.num_streams]
            out[epochs == epoch] = mine[positions[epochs == epoch]]
        return out

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self.sources):
                self._perm_cache.clear()
            rng = np.random.default_rng((self.seed, source, epoch))
            self._perm_cache[key] = rng.permutation(len(self.sources[source]))
        return self._perm_cache[key]


class RowStream:
    """Packed rows of one stream from a cursor (chunk, rows taken), one fresh packer per chunk."""

    def __init__(
        self,
        docs: DocumentStream,
        config: DataConfig,
        pad_id: int,
        cursor: tuple[int, int] = (0, 0),
    ) -> None:
        self.docs, self.config, self.pad_id = docs, config, pad_id
        self.cursor = tuple(cursor)

    def __iter__(self) -> Iterator[PackedRow]:
        chunk, skip = self.cursor
        while True:
            taken = 0
            for row in self._packer(chunk).pack(self.docs.documents(chunk)):
                taken += 1
                if taken <= skip:
                    continue
                self.cursor = (chunk, taken)
                yield row
            chunk, skip = chunk + 1, 0

    def _packer(self, chunk: int):
        seed = _mix(self.config.seed, self.docs.stream, chunk)
        return make_packer(
            self.config.packer,
            self.config.seq_len,
            pad_id=self.pad_id,
            buffer_size=self.config.buffer_size,
            seed=seed,
        )


def _mix(*values: int) -> int:
    digest = hashlib.sha256(repr(values).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class BatchStream:
    """Micro-batches of one stream; ``cursor`` is the stream position after the last batch."""

    def __init__(self, rows: RowStream, config: DataConfig, batch_index: int) -> None:
        self.rows, self.config = rows, config
        self.batch_index = batch_index  # index of the next batch this stream yields
        self._it = iter(rows)

    def next_rows(self) -> list[PackedRow]:
        rows = [next(self._it) for _ in range(self.config.micro_batch_size)]
        self.batch_index += 1
        return rows

    def collate(self, rows: list[PackedRow]) -> PackedBatch:
        return collate_rows(
            rows,
            reset_position_ids=self.config.reset_position_ids,
            document_mask=self.config.document_mask,
        )


# --------------------------------------------------------------------------- datasets
class TrainStream(IterableDataset):
    """Yields this rank's batches ``start, start + 1, ...`` up to the end of the Lightning epoch."""

    def __init__(
        self,
        sources,
        weights,
        config: DataConfig,
        pad_id: int,
        rank: int,
        world_size: int,
        batches_per_epoch: int,
    ) -> None:
        self.sources, self.weights, self.config, self.pad_id = sources, weights, config, pad_id
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = batches_per_epoch
        self.start = 0  # set from the progress when an iterator starts
        self.cursors: dict[int, tuple[int, int]] = {}  # stream -> cursor at its first batch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_end(self, start: int) -> int:
        return (start // self.batches_per_epoch + 1) * self.batches_per_epoch

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        streams: dict[int, BatchStream] = {}
        num = self.config.effective_streams
        for g in range(self.start + worker, self.epoch_end(self.start), workers):
            s = g % num
            stream = streams.get(s) or streams.setdefault(s, self._open_stream(s))
            while stream.batch_index < g // num:  # other workers' batches of this stream
                stream.next_rows()
            batch = stream.collate(stream.next_rows())
            setattr(batch, _META, (g, s, stream.rows.cursor))
            yield batch

    def _open_stream(self, s: int) -> BatchStream:
        num = self.config.effective_streams
        docs = DocumentStream(
            self.sources,
            self.weights,
            self.config.seed,
            self.rank * num + s,
            self.world_size * num,
            self.config.chunk_documents,
        )
        rows = RowStream(docs, self.config, self.pad_id, self.cursors.get(s, (0, 0)))
        first = -(-(self.start - s) // num) if self.start > s else 0  # next unconsumed batch
        return BatchStream(rows, self.config, first)


class FixedBatches(IterableDataset):
    def __init__(self, batches: list[PackedBatch]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        if info is not None and info.id > 0:
            return iter(())
        return iter(self.batches)


def _identity(batch):
    return batch


def _worker_init(worker_id: int, rank: int) -> None:
    """Stop signals are the main process's to handle: a SIGTERM to the process group
    (scancel, timeout) or Ctrl-C would otherwise kill the workers (torch's worker handler
    dies on a SIGTERM not sent by its parent) before the main process saved its checkpoint.
    The workers still exit with the main process (the loader's shutdown, its watchdog)."""
    for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if os.environ.get("PL_SEED_WORKERS") == "1":  # Lightning adds this only without ours
        pl_worker_init_function(worker_id, rank)


class _TrainLoader(DataLoader):
    """A DataLoader that reads the resume position when an iterator starts."""

    def __init__(self, dataset: TrainStream, progress: _Progress, **kwargs) -> None:
        super().__init__(dataset, batch_size=None, collate_fn=_identity, **kwargs)
        self.progress = progress

    def __iter__(self):
        self.dataset.start = self.progress.consumed
        self.dataset.cursors = dict(self.progress.cursors)
        for batch in super().__iter__():
            if not self.progress.counted_by_trainer:
                self.progress.record(batch)
            yield batch


@dataclasses.dataclass
class _Progress:
    consumed: int = 0  # batches this rank's training loop has taken (whole run)
    cursors: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    counted_by_trainer: bool = False

    def record(self, batch: PackedBatch) -> None:
        meta = batch.__dict__.get(_META)
        if meta is None:
            return
        g, s, cursor = meta
        if g != self.consumed:
            raise RuntimeError(
                f"train batch {g} arrived, expected batch {self.consumed}: the "
                "batch order is broken (was the iterator shared?)"
            )
        self.cursors[s] = tuple(cursor)
        self.consumed = g + 1


# --------------------------------------------------------------------------- datamodule
class LongCtxDataModule(L.LightningDataModule):
    """Packed PackedBatch streams from prepared shard folders (or the embedded corpus)."""

    def __init__(
        self,
        config: DataConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        context_parallel: int = 1,
    ) -> None:
        """rank / world_size: data-parallel ones, fixed here (tests) or taken from the trainer;
        context_parallel: ranks sharing each row, which all read the same batches."""
        super().__init__()
        self.config = config
        self._rank, self._world = rank, world_size
        self.context_parallel = context_parallel
        self._progress = _Progress()
        self._folders: list[Path] | None = None
        self._manifests: list[Manifest] | None = None
        self._train: list[ShardSet] | None = None
        self._val_batches: list[PackedBatch] | None = None

    # ------------------------------------------------------------------ corpus
    def prepare_data(self) -> None:
        for folder in self._resolve_folders():  # a bad manifest fails here, named as itself
            load_manifest(folder)

    def setup(self, stage: str | None = None) -> None:
        self._open()
        self._progress.counted_by_trainer = self.trainer is not None

    def _resolve_folders(self) -> list[Path]:
        if self._folders is None:
            if self.config.shards is None:
                self._folders = [default_corpus_dir(self.config.cache_dir)]
            else:
                if not self.config.shards:
                    raise ValueError("DataConfig.shards=[]; expected prepared folders or None")
                self._folders = [Path(f) for f in self.config.shards]
        return self._folders

    def _open(self) -> list[ShardSet]:
        if self._train is None:
            folders = self._resolve_folders()
            manifests = [load_manifest(f) for f in folders]
            _check_same_tokenizer(folders, manifests)
            train = [ShardSet(f, "train") for f in folders]
            for folder, shard_set in zip(folders, train, strict=True):
                if shard_set.num_documents == 0:
                    raise ValueError(
                        f"{folder} has no training documents; expected a non-empty corpus"
                    )
            self._manifests, self._train = manifests, train
        return self._train

    @property
    def manifest(self) -> Manifest:
        self._open()
        return self._manifests[0]

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    @property
    def eos_id(self) -> int:
        return self.manifest.eos_id

    @property
    def pad_id(self) -> int:
        return self.manifest.pad_id

    def unigram_baseline(self) -> float:
        """Validation cross-entropy of the training split's unigram distribution (nats/token)."""
        folder = self._resolve_folders()[0]
        train, val = ShardSet(folder, "train"), ShardSet(folder, "val")
        docs = lambda shards: (shards.document(i) for i in range(len(shards)))  # noqa: E731
        return unigram_cross_entropy(docs(train), docs(val), self.vocab_size)

    def check_vocab(self, model_vocab_size: int) -> None:
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"the corpus in {self._resolve_folders()[0]} has vocab_size {self.vocab_size} "
                f"(tokenizer {self.manifest.tokenizer}), more than the model's "
                f"{model_vocab_size}; expected a model vocabulary >= the tokenizer's"
            )

    # ------------------------------------------------------------------ topology
    @property
    def rank(self) -> int:
        return self._topology()[0]

    @property
    def world_size(self) -> int:
        return self._topology()[1]

    def _topology(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel size)."""
        if self._rank is not None or self._world is not None:
            rank, world = self._rank or 0, self._world or 1
        elif self.trainer is not None:
            rank, world = self.trainer.global_rank, self.trainer.world_size
            rank, world = data_parallel_rank_and_size(rank, world, self.context_parallel)
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            rank, world = data_parallel_rank_and_size(rank, world, self.context_parallel)
        else:
            rank, world = 0, 1
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank}, world_size={world}; expected 0 <= rank < world_size")
        return rank, world

    # ------------------------------------------------------------------ loaders
    def batches_per_epoch(self) -> int:
        tokens = sum(s.num_tokens for s in self._open())
        per_batch = self.world_size * self.config.micro_batch_size * self.config.seq_len
        if tokens < per_batch:
            raise ValueError(
                f"the training corpus has {tokens} tokens, fewer than one batch on every rank "
                f"(world_size * micro_batch_size * seq_len = {per_batch}); use a larger corpus "
                "or a smaller seq_len"
            )
        return tokens // per_batch

    def train_dataset(self) -> TrainStream:
        sources = self._open()
        rank, world = self._topology()
        num_streams = world * self.config.effective_streams
        for folder, shard_set in zip(self._folders, sources, strict=True):
            if shard_set.num_documents < num_streams:
                raise ValueError(
                    f"{folder} has {shard_set.num_documents} training documents, fewer than "
                    f"the {num_streams} streams (world_size {world} x streams_per_rank "
                    f"{self.config.effective_streams}); expected at least one per stream"
                )
        weights = np.asarray(self.config.weights or [1.0] * len(sources), dtype=np.float64)
        return TrainStream(
            sources,
            weights / weights.sum(),
            self.config,
            self.pad_id,
            rank,
            world,
            self.batches_per_epoch(),
        )

    def train_dataloader(self) -> DataLoader:
        workers = self.config.num_workers
        return _TrainLoader(
            self.train_dataset(),
            self._progress,
            num_workers=workers,
            pin_memory=self.config.pin_memory and torch.cuda.is_available(),
            persistent_workers=False,  # each iterator must start at the current position
            prefetch_factor=2 if workers else None,
            worker_init_fn=functools.partial(_worker_init, rank=self.rank),
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._topology()
        mine = self._validation_batches(world)[rank]
        return DataLoader(
            FixedBatches(mine),
            batch_size=None,
            collate_fn=_identity,
            pin_memory=self.config.pin_memory and torch.cuda.is_available(),
        )

    def validation_rows(self) -> list[PackedRow]:
        """The first ``val_rows`` rows of the first folder's val split, packed in file order."""
        folder = self._resolve_folders()[0]
        val = ShardSet(folder, "val")
        packer = make_packer(
            self.config.packer,
            self.config.seq_len,
            pad_id=self.pad_id,
            buffer_size=self.config.buffer_size,
            seed=self.config.seed,
        )
        docs = (val.document(i) for i in range(val.num_documents))
        rows = list(itertools.islice(packer.pack(docs), self.config.val_rows))
        if len(rows) < self.config.val_rows:
            raise ValueError(
                f"the val split of {folder} packs into {len(rows)} rows of {self.config.seq_len}"
                f" tokens, fewer than val_rows={self.config.val_rows}; lower val_rows or "
                "prepare with a larger val fraction"
            )
        return rows

    def val_documents(self, limit: int) -> list[np.ndarray]:
        """The first ``limit`` documents of the first folder's val split (fewer if it has fewer):
        the held-out documents every arm is scored on (longctx.eval.documents)."""
        val = ShardSet(self._resolve_folders()[0], "val")
        return [val.document(i) for i in range(min(limit, val.num_documents))]

    def _validation_batches(self, world: int) -> list[list[PackedBatch]]:
        """Per-rank batches of the fixed validation rows (rows r::world go to rank r)."""
        if self.config.val_rows % world:
            raise ValueError(
                f"DataConfig.val_rows={self.config.val_rows}; expected a multiple "
                f"of world_size={world} so every rank evaluates as many rows"
            )
        rows = self.validation_rows()
        out = []
        for rank in range(world):
            mine, b = rows[rank::world], self.config.micro_batch_size
            out.append(
                [
                    collate_rows(
                        mine[i : i + b],
                        reset_position_ids=self.config.reset_position_ids,
                        document_mask=self.config.document_mask,
                    )
                    for i in range(0, len(mine), b)
                ]
            )
        return out

    # ------------------------------------------------------------------ progress
    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training:
            self._progress.record(batch)
        return batch

    def state_dict(self) -> dict:
        local = {
            "consumed": self._progress.consumed,
            "cursors": {int(s): list(c) for s, c in self._progress.cursors.items()},
        }
        ranks = {self.rank: local}
        if self._gathers():  # every process; context-parallel ranks hold equal copies
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, (self.rank, local))
            ranks = dict(gathered)
        return {"version": STATE_VERSION, "fingerprint": self._fingerprint(), "ranks": ranks}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')}; expected {STATE_VERSION}")
        mine, saved = self._fingerprint(), state["fingerprint"]
        changed = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if changed:
            hint = (
                "; world_size is the data-parallel size (processes / context_parallel): keep it "
                "(a change of context_parallel that keeps it resumes exactly)"
                if "world_size" in changed
                else ""
            )
            raise ValueError(
                f"cannot resume the data stream exactly: settings changed since the "
                f"checkpoint (saved, now): {changed}{hint}"
            )
        ranks = {int(r): v for r, v in state["ranks"].items()}
        if self.rank not in ranks:
            raise ValueError(f"the data state holds ranks {sorted(ranks)}, not rank {self.rank}")
        local = ranks[self.rank]
        self._progress.consumed = int(local["consumed"])
        self._progress.cursors = {int(s): tuple(c) for s, c in local["cursors"].items()}

    def _gathers(self) -> bool:
        return (
            self._rank is None
            and self.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )

    def _fingerprint(self) -> dict:
        c = self.config
        return {
            "folders": [m.input_hash for m in (self._manifests or self._load_manifests())],
            "weights": c.weights,
            "seq_len": c.seq_len,
            "packer": c.packer,
            "micro_batch_size": c.micro_batch_size,
            "seed": c.seed,
            "buffer_size": c.buffer_size,
            "streams_per_rank": c.effective_streams,
            "chunk_documents": c.chunk_documents,
            "world_size": self.world_size,
        }

    def _load_manifests(self) -> list[Manifest]:
        self._open()
        return self._manifests


def _check_same_tokenizer(folders: list[Path], manifests: list[Manifest]) -> None:
    first = manifests[0]
    for folder, m in zip(folders[1:], manifests[1:], strict=True):
        if (m.tokenizer, m.vocab_size, m.eos_id, m.pad_id) != (
            first.tokenizer,
            first.vocab_size,
            first.eos_id,
            first.pad_id,
        ):
            raise ValueError(
                f"{folder} was prepared with tokenizer {m.tokenizer}, {folders[0]} "
                f"with {first.tokenizer}; expected one tokenizer for all folders"
            )
