"""LongCtxDataModule: prepared shards -> packed rows -> PackedBatch, with exact (elastic) resume.

How the document stream is cut (and why):

* Streams. The run has ``N = num_streams`` global streams (default ``max(1, num_workers)``), a
  number that does not depend on the world size. Per data epoch ``e`` a seeded permutation
  ``perm_e`` of a source's documents is drawn (numpy, ``seed, source, e``) and stream ``k`` takes
  ``perm_e[k::N]``: the streams cover every document of the epoch exactly once. With several
  sources, each document slot of a stream picks its source from a seeded draw with the mixing
  weights; each source then cycles through its own epochs independently.
* Chunks. A stream's (endless) document sequence is cut into chunks of ``chunk_documents``
  documents, each packed by a fresh packer; rows flow on from chunk to chunk. A chunk is a
  multiple of the best-fit buffer, so chunking changes nothing but one padded row per chunk.
  The cursor of a stream is (chunk, rows already taken from it): resuming replays at most one
  chunk, never the whole history.
* Global micro-batches. The run's micro-batch ``u`` (``micro_batch_size`` rows, counted over all
  ranks) is batch ``u // N`` of stream ``u % N``: the global row order is a function of ``N``
  alone, the same for any number of data-parallel ranks (and context-parallel ranks, which share
  their rows). Each round of ``D`` data-parallel ranks takes the next ``D`` micro-batches, rank
  ``r`` the ``r``-th, so an optimizer step of ``accumulation x D`` micro-batches trains on the
  same rows whatever ``D`` is. When ``N`` is a multiple of ``D x max(1, num_workers)`` every
  DataLoader worker reads streams of its own; otherwise ranks and workers share streams and each
  packs rows that others take (same order, more packing work; a warning says so).
* Workers. A DataLoader worker ``w`` of ``W`` produces a rank's rounds ``w, w + W, ...``, which
  the DataLoader's in-order round robin delivers in order: the batch sequence does not depend on
  ``num_workers``.
* Equal batches per rank. Streams never run dry (they go on into the next data epoch), and a
  Lightning epoch is a fixed ``batches_per_epoch = train tokens // (D * B * L)`` rounds on
  every rank, so ranks always step together (no DDP hang). The last rows of a data epoch are
  packed together with the first documents of the next.
* Exact, elastic resume. The state is the number of global rows the training loop consumed
  (counted in ``on_before_batch_transfer``, after Lightning's prefetch, so prefetched batches do
  not count) plus each stream's position (batches taken, cursor) after its last consumed batch,
  gathered from every rank. A resume on another data-parallel size starts each rank at its share
  of the rows that follow. The iterator reads the state when it starts, so a train dataloader
  built early (``trainer.estimated_stepping_batches``) loses nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from longctx.batch import PackedBatch
from longctx.data.corpus import default_corpus_dir
from longctx.data.shards import Manifest, ShardSet, load_manifest
from longctx.distributed.context import data_parallel_rank_and_size
from longctx.eval.baselines import unigram_cross_entropy
from longctx.packing import PackedRow, collate_rows, make_packer

# attribute a train batch carries: (first global micro-batch of its round, ranks in the round,
# stream, the stream's position after it)
_META = "_longctx_stream_meta"
# 2: global rows consumed and global stream positions (elastic resume); 1 was per rank
STATE_VERSION = 2


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
    # global streams: with the seed, they fix the row order, for any number of ranks. None ->
    # max(1, num_workers). A multiple of (data-parallel ranks x num_workers) packs each row once
    num_streams: int | None = None
    chunk_documents: int = 10_000  # resume replays at most this many documents per stream
    # a prepared folder of long documents no training row contains (longctx.eval.long_documents);
    # None -> the embedded corpus's held-out books (only with shards=None)
    long_documents: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shards, str):  # data.shards=/one/folder: one source, not its letters
            self.shards = [self.shards]
        for name in ("seq_len", "micro_batch_size", "buffer_size", "val_rows", "chunk_documents"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(self.num_workers >= 0, "num_workers", self.num_workers, ">= 0")
        if self.num_streams is not None:
            _require(self.num_streams >= 1, "num_streams", self.num_streams, ">= 1")
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
        return self.num_streams or max(1, self.num_workers)


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
            perm = epoch_permutation(self.seed, source, int(epoch), len(self.sources[source]))
            mine = perm[self.stream :: self.num_streams]
            out[epochs == epoch] = mine[positions[epochs == epoch]]
        return out


@functools.lru_cache(maxsize=16)  # shared by the streams of a process: one copy per epoch
def epoch_permutation(seed: int, source: int, epoch: int, num_documents: int) -> np.ndarray:
    """The order of a source's documents in a data epoch."""
    perm = np.random.default_rng((seed, source, epoch)).permutation(num_documents)
    perm.flags.writeable = False
    return perm


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


class StreamPosition(NamedTuple):
    """Where a stream stands: batches taken from it, and its row cursor after them."""

    batches: int = 0
    chunk: int = 0
    rows: int = 0  # rows already taken from the chunk


class BatchStream:
    """Micro-batches of one stream, from a position."""

    def __init__(self, rows: RowStream, config: DataConfig, batch_index: int) -> None:
        self.rows, self.config = rows, config
        self.batch_index = batch_index  # index of the next batch this stream yields
        self._it = iter(rows)

    @classmethod
    def at(cls, docs: DocumentStream, config: DataConfig, pad_id: int, at: StreamPosition):
        rows = RowStream(docs, config, pad_id, (at.chunk, at.rows))
        return cls(rows, config, at.batches)

    def position(self) -> StreamPosition:
        return StreamPosition(self.batch_index, *self.rows.cursor)

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
def micro_batch_source(micro_batch: int, num_streams: int) -> tuple[int, int]:
    """(stream, batch index in it) of the run's global micro-batch ``micro_batch``."""
    return micro_batch % num_streams, micro_batch // num_streams


class TrainStream(IterableDataset):
    """Yields this rank's micro-batches, from global micro-batch ``start`` to the end of the
    Lightning epoch: in round ``n`` rank ``r`` takes global micro-batch ``start + n * D + r``."""

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
        self.start = 0  # global micro-batches consumed when an iterator starts (from the progress)
        self.positions: dict[int, StreamPosition] = {}  # stream -> position after its last batch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def rounds_left(self) -> int:
        """Rounds from ``start`` to the end of its Lightning epoch."""
        per_epoch = self.batches_per_epoch * self.world_size
        end = (self.start // per_epoch + 1) * per_epoch
        return -(-(end - self.start) // self.world_size)

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        streams: dict[int, BatchStream] = {}
        for n in range(worker, self.rounds_left(), workers):
            first = self.start + n * self.world_size
            k, index = micro_batch_source(first + self.rank, self.config.effective_streams)
            stream = streams.get(k) or streams.setdefault(k, self._open_stream(k))
            if stream.batch_index > index:
                raise RuntimeError(
                    f"stream {k} is at batch {stream.batch_index}, past batch {index} that "
                    f"global micro-batch {first + self.rank} needs: the resume state is inconsistent"
                )
            while stream.batch_index < index:  # batches of this stream other ranks/workers take
                stream.next_rows()
            batch = stream.collate(stream.next_rows())
            setattr(batch, _META, (first, self.world_size, k, stream.position()))
            yield batch

    def _open_stream(self, k: int) -> BatchStream:
        docs = DocumentStream(
            self.sources,
            self.weights,
            self.config.seed,
            k,
            self.config.effective_streams,
            self.config.chunk_documents,
        )
        at = self.positions.get(k, StreamPosition())
        return BatchStream.at(docs, self.config, self.pad_id, at)


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
        self.dataset.start = self.progress.micro_batches
        self.dataset.positions = dict(self.progress.positions)
        for batch in super().__iter__():
            if not self.progress.counted_by_trainer:
                self.progress.record(batch)
            yield batch


@dataclasses.dataclass
class _Progress:
    micro_batches: int = 0  # global micro-batches the training loops of all ranks have taken
    positions: dict[int, StreamPosition] = dataclasses.field(default_factory=dict)
    counted_by_trainer: bool = False

    def record(self, batch: PackedBatch) -> None:
        meta = batch.__dict__.get(_META)
        if meta is None:
            return
        first, ranks, stream, position = meta
        if first != self.micro_batches:
            raise RuntimeError(
                f"a train batch of the round from global micro-batch {first} arrived, expected "
                f"the round from {self.micro_batches}: the batch order is broken (was the "
                "iterator shared?)"
            )
        self.positions[stream] = position
        self.micro_batches = first + ranks


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
        num_streams = self.config.effective_streams
        for folder, shard_set in zip(self._folders, sources, strict=True):
            if shard_set.num_documents < num_streams:
                raise ValueError(
                    f"{folder} has {shard_set.num_documents} training documents, fewer than "
                    f"the {num_streams} streams (DataConfig.num_streams); expected at least one "
                    "per stream"
                )
        _warn_shared_streams(num_streams, world, self.config.num_workers)
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
        """Global rows consumed and every stream's position, merged over all ranks."""
        local = {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "rows_consumed": self._progress.micro_batches * self.config.micro_batch_size,
            "streams": {int(k): list(p) for k, p in self._progress.positions.items()},
        }
        states = [local]
        if self._gathers():  # every process; context-parallel ranks hold equal copies
            states = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, local)
        return merge_rank_states(states)

    def load_state_dict(self, state: dict) -> None:
        check_state_version(state)
        mine, saved = self._fingerprint(), state["fingerprint"]
        changed = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if changed:
            hint = (
                f"; data.num_streams=null follows num_workers: set data.num_streams="
                f"{saved['num_streams']} to keep the row order"
                if "num_streams" in changed and self.config.num_streams is None
                else ""
            )
            raise ValueError(
                f"cannot resume the data stream exactly: settings changed since the "
                f"checkpoint (saved, now): {changed}{hint}"
            )
        rows, per_micro_batch = int(state["rows_consumed"]), self.config.micro_batch_size
        if rows % per_micro_batch:
            raise ValueError(
                f"the data state has consumed {rows} rows, not a whole number of micro-batches "
                f"of micro_batch_size={per_micro_batch}"
            )
        self._progress.micro_batches = rows // per_micro_batch
        self._progress.positions = {int(k): StreamPosition(*p) for k, p in state["streams"].items()}

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
            "num_streams": c.effective_streams,
            "chunk_documents": c.chunk_documents,
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


def check_state_version(state: dict) -> None:
    """A data state this version can continue; one from before elastic resume is refused."""
    version = state.get("version")
    if version == STATE_VERSION:
        return
    missing = [k for k in ("rows_consumed", "streams") if k not in state]
    raise ValueError(
        f"the checkpoint's data state has version {version}, expected {STATE_VERSION}: it was "
        f"written before elastic resume and lacks {missing or 'the global row order'} (its "
        "positions are per rank, in a row order that depended on the world size), so its data "
        "order cannot be continued; finish the run with the longctx version that wrote it, or "
        "start a new run"
    )


def merge_rank_states(states: list[dict]) -> dict:
    """One data state from every rank's: the ranks must agree on rows consumed; a stream (some
    are shared by ranks) keeps the position after its furthest consumed batch."""
    first = states[0]
    rows = {s["rows_consumed"] for s in states}
    if len(rows) != 1:
        raise RuntimeError(
            f"the ranks disagree on the global rows consumed ({sorted(rows)}): a checkpoint "
            "must be taken with every rank at the same micro-batch"
        )
    streams: dict[int, list[int]] = {}
    for state in states:
        for k, position in state["streams"].items():
            if k not in streams or position[0] > streams[k][0]:
                streams[k] = list(position)
    return {**first, "streams": dict(sorted(streams.items()))}


def _warn_shared_streams(num_streams: int, ranks: int, workers: int) -> None:
    readers = ranks * max(1, workers)
    if num_streams % readers:
        share = readers // math.gcd(num_streams, readers)
        rank_zero_warn(
            f"DataConfig.num_streams={num_streams} is not a multiple of data-parallel ranks x "
            f"workers = {ranks} x {max(1, workers)}: readers share streams and each packs about "
            f"{share}x the rows it uses (the row order is unaffected); set data.num_streams to a "
            f"multiple of {readers} to pack each row once"
        )
