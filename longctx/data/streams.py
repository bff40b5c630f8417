"""The training row order as a pure function of the seed and the stream count: no Lightning.

LongCtxDataModule (datamodule.py) wires these streams into Lightning and checkpoints.

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
* Stages (``data.stages``). The global micro-batches of stage ``s`` are a range of their own
  (``until_step x`` micro-batches per step); inside it micro-batch ``v`` is batch ``v // N`` of
  stream ``v % N``, packed at the stage's length. At a stage boundary every stream goes on at
  its next chunk with the new length (the rest of its current chunk, at most
  ``chunk_documents`` documents, is skipped): the documents keep flowing, and where a stream
  starts in stage ``s`` follows from where it stood in stage ``s - 1``.
* Length upsampling (``data.length_upsampling``). A data epoch of a source is a permutation of
  its slots: every document once, and a long one ``factor`` times.
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
import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from longctx.batch import PackedBatch
from longctx.data.config import DataConfig
from longctx.data.dp_balance import RowCost, StepPlan, balance_step
from longctx.data.packing import PackedRow, Packer, collate_rows, make_packer
from longctx.data.shards import ShardSet
from longctx.errors import LongctxError

# 2: global rows consumed and global stream positions (elastic resume); 1 was per rank
STATE_VERSION = 2


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
        slots: list[np.ndarray] | None = None,
    ) -> None:
        self.sources, self.weights, self.seed = sources, weights, seed
        self.stream, self.num_streams, self.chunk = stream, num_streams, chunk_documents
        # a source's data epoch: these document ids, permuted (every document once by default)
        self.slots = slots or [np.arange(len(s)) for s in sources]
        self.shares = [len(range(stream, len(s), num_streams)) for s in self.slots]
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
        slots = self.slots[source]
        for epoch in np.unique(epochs):
            perm = epoch_permutation(self.seed, source, int(epoch), len(slots))
            mine = perm[self.stream :: self.num_streams]
            out[epochs == epoch] = slots[mine[positions[epochs == epoch]]]
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
        return packer_for(self.config, self.pad_id, _mix(self.config.seed, self.docs.stream, chunk))


def packer_for(config: DataConfig, pad_id: int, seed: int) -> Packer:
    """The packer ``config`` names, with its buffer, BOS and answer keys."""
    return make_packer(
        config.packer,
        config.seq_len,
        pad_id=pad_id,
        buffer_size=config.buffer_size,
        seed=seed,
        bos_id=config.bos_id,
        answer_keys=config.answer_keys,
    )


def _mix(*values: int) -> int:
    digest = hashlib.sha256(repr(values).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class StreamPosition(NamedTuple):
    """Where a stream stands: batches taken from it in its stage, and its row cursor after them."""

    batches: int = 0
    chunk: int = 0
    rows: int = 0  # rows already taken from the chunk
    stage: int = 0  # last: a data state written before stages reads as stage 0

    def next_stage(self) -> StreamPosition:
        """The start of the next stage: the next chunk, unless this one was never read from."""
        return StreamPosition(0, self.chunk + (self.rows > 0), 0, self.stage + 1)


class BatchStream:
    """Micro-batches of one stream, from a position."""

    def __init__(
        self, rows: RowStream, config: DataConfig, batch_index: int, stage: int = 0
    ) -> None:
        self.rows, self.config, self.stage = rows, config, stage
        self.batch_index = batch_index  # index of the next batch this stream yields
        self._it = iter(rows)

    @classmethod
    def at(cls, docs: DocumentStream, config: DataConfig, pad_id: int, at: StreamPosition):
        rows = RowStream(docs, config, pad_id, (at.chunk, at.rows))
        return cls(rows, config, at.batches, at.stage)

    def position(self) -> StreamPosition:
        return StreamPosition(self.batch_index, *self.rows.cursor, self.stage)

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


class BatchOrigin(NamedTuple):
    """Where a train micro-batch sits in the global row order."""

    first: int  # the first global micro-batch of its round
    ranks: int  # data-parallel ranks in the round
    stage: int
    # (stream, its position after this batch) to record once the batch is consumed: the batch's
    # own stream; under data.dp_balance every stream of the step after its last round, none before
    positions: tuple[tuple[int, StreamPosition], ...]


@dataclasses.dataclass
class StreamBatch(PackedBatch):
    """A train batch that knows its origin, which the resume bookkeeping (Progress) records,
    and how its rows were packed (pad and documents as the packer counted them)."""

    origin: BatchOrigin | None = None
    pad_tokens: int = 0
    documents: int = 0  # document segments: whole documents or fragments

    @classmethod
    def of_rows(
        cls, batch: PackedBatch, rows: list[PackedRow], origin: BatchOrigin | None = None
    ) -> StreamBatch:
        """``batch`` (collated from ``rows``) with its origin and the rows' packing counts."""
        return cls(
            batch.tokens,
            batch.labels,
            batch.position_ids,
            batch.seq_lens,
            origin,
            pad_tokens=sum(row.pad_tokens for row in rows),
            documents=sum(row.documents for row in rows),
        )

    @property
    def packing_efficiency(self) -> float:
        """Fraction of the batch's tokens that are document tokens (not pad)."""
        return 1.0 - self.pad_tokens / self.tokens.numel()

    @property
    def docs_per_row(self) -> float:
        return self.documents / self.tokens.shape[0]


def upsampled_slots(lengths: np.ndarray, min_tokens: int, factor: int) -> np.ndarray:
    """A source's data epoch before its permutation: every document id, and ``factor - 1``
    more copies of each with at least ``min_tokens`` tokens."""
    ids = np.arange(len(lengths))
    return np.concatenate([ids, np.repeat(ids[lengths >= min_tokens], factor - 1)])


def slot_probabilities(
    weights: np.ndarray, lengths: list[np.ndarray], slots: list[np.ndarray], per_source: bool
) -> np.ndarray:
    """The chance a document slot goes to each source. A source's token share is its chance
    times its mean document length; ``per_source`` scales each chance by (mean length before
    upsampling / after) so every share stays what the weights made it."""
    if not per_source:
        return weights
    scale = [n.mean() / n[s].mean() for n, s in zip(lengths, slots, strict=True)]
    scaled = weights * np.asarray(scale)
    return scaled / scaled.sum()


def long_token_share(
    probabilities: np.ndarray, lengths: list[np.ndarray], slots: list[np.ndarray], min_tokens: int
) -> float:
    """Expected fraction of training tokens from documents of at least ``min_tokens`` tokens."""
    long = total = 0.0
    for p, n, s in zip(probabilities, lengths, slots, strict=True):
        drawn = n[s]
        long += p * np.where(drawn >= min_tokens, drawn, 0).mean()
        total += p * drawn.mean()
    return float(long / total)


def micro_batch_source(micro_batch: int, num_streams: int) -> tuple[int, int]:
    """(stream, batch index in it) of a global micro-batch, counted from its stage's start."""
    return micro_batch % num_streams, micro_batch // num_streams


class StageSchedule:
    """The global micro-batches of each stage: stage ``s`` is ``[starts[s], starts[s + 1])``,
    ``until_step x micro_batches_per_step`` (all ranks' micro-batches of one optimizer step)."""

    def __init__(self, config: DataConfig, micro_batches_per_step: int) -> None:
        self.configs = config.stage_configs()
        ends = [s.until_step * micro_batches_per_step for s in config.stages or []]
        self.starts = [0, *ends]

    def stage_of(self, micro_batch: int) -> int:
        return sum(micro_batch >= start for start in self.starts[1:])

    def batches_of_stream(self, stage: int, stream: int, num_streams: int) -> int:
        """How many batches ``stream`` yields in a (finite) earlier stage."""
        return len(range(stream, self.starts[stage + 1] - self.starts[stage], num_streams))

    def _spans(self):
        """(first micro-batch, end or inf, config) of every stage."""
        return zip(self.starts, [*self.starts[1:], math.inf], self.configs, strict=True)

    def rows_before(self, micro_batch: int) -> int:
        """Rows in the global micro-batches before ``micro_batch``."""
        return sum(
            max(0, min(micro_batch, end) - start) * config.micro_batch_size
            for start, end, config in self._spans()
        )

    def micro_batches_for(self, rows: int) -> int:
        """The global micro-batches that hold ``rows`` rows (the inverse of rows_before)."""
        micro_batches, left = 0, rows
        for stage, (start, end, config) in enumerate(self._spans()):
            take = min(left, (end - start) * config.micro_batch_size)
            if take % config.micro_batch_size:
                raise LongctxError(
                    f"the data state has consumed {rows} rows, which ends inside a micro-batch "
                    f"of stage {stage} (micro_batch_size={config.micro_batch_size})"
                )
            micro_batches, left = micro_batches + int(take) // config.micro_batch_size, left - take
        return micro_batches


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
        schedule: StageSchedule | None = None,
        slots: list[np.ndarray] | None = None,
        balance: StepBalance | None = None,
    ) -> None:
        """``balance``: reorder each optimizer step's rows over the ranks (data.dp_balance)."""
        self.sources, self.weights, self.config, self.pad_id = sources, weights, config, pad_id
        self.balance = balance
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = batches_per_epoch
        self.schedule = schedule or StageSchedule(config, 1)
        self.slots = slots
        self.start = 0  # global micro-batches consumed when an iterator starts (from the progress)
        self.positions: dict[int, StreamPosition] = {}  # stream -> position after its last batch

    def __len__(self) -> int:
        return self.batches_per_epoch

    def rounds_left(self) -> int:
        """Rounds from ``start`` to the end of its Lightning epoch."""
        per_epoch = self.batches_per_epoch * self.world_size
        end = (self.start // per_epoch + 1) * per_epoch
        return -(-(end - self.start) // self.world_size)

    def __iter__(self) -> Iterator[StreamBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        reader = StreamReader(self)
        steps = BalancedSteps(self, reader) if self.balance else None
        for n in range(worker, self.rounds_left(), workers):
            first = self.start + n * self.world_size
            yield steps.batch(first) if steps else self.stream_batch(reader, first)

    def stream_batch(self, reader: StreamReader, first: int) -> StreamBatch:
        """This rank's micro-batch of the round from ``first``: global micro-batch
        ``first + rank``, as the streams cut it."""
        k, stream, rows = reader.read(first + self.rank)
        origin = BatchOrigin(first, self.world_size, stream.stage, ((k, stream.position()),))
        return StreamBatch.of_rows(stream.collate(rows), rows, origin)

    def open_stream(self, k: int, stage: int = 0) -> BatchStream:
        """Stream ``k`` in ``stage``, from its last known position, carried over the
        boundaries of the stages in between."""
        docs = DocumentStream(
            self.sources,
            self.weights,
            self.config.seed,
            k,
            self.config.effective_streams,
            self.config.chunk_documents,
            self.slots,
        )
        at = self.positions.get(k, StreamPosition())
        if at.stage > stage:
            raise RuntimeError(
                f"stream {k} is in stage {at.stage}, past stage {stage} that the next batch "
                "needs: the resume state is inconsistent"
            )
        while at.stage < stage:
            stream = BatchStream.at(docs, self.schedule.configs[at.stage], self.pad_id, at)
            end = self.schedule.batches_of_stream(at.stage, k, self.config.effective_streams)
            while stream.batch_index < end:
                stream.next_rows()
            at = stream.position().next_stage()
        return BatchStream.at(docs, self.schedule.configs[stage], self.pad_id, at)


class StreamReader:
    """Reads global micro-batches in increasing order (per stream) from a TrainStream's
    streams, opened where its resume state says they stand."""

    def __init__(self, dataset: TrainStream) -> None:
        self.dataset = dataset
        self.streams: dict[tuple[int, int], BatchStream] = {}  # (stage, stream) -> stream

    def read(self, micro_batch: int) -> tuple[int, BatchStream, list[PackedRow]]:
        """(stream k, the stream after it, the rows) of global micro-batch ``micro_batch``."""
        d = self.dataset
        stage = d.schedule.stage_of(micro_batch)
        k, index = micro_batch_source(
            micro_batch - d.schedule.starts[stage], d.config.effective_streams
        )
        stream = self.streams.get((stage, k)) or self.streams.setdefault(
            (stage, k), d.open_stream(k, stage)
        )
        if stream.batch_index > index:
            raise RuntimeError(
                f"stream {k} is at batch {stream.batch_index}, past batch {index} that "
                f"global micro-batch {micro_batch} needs: the resume state is inconsistent"
            )
        while stream.batch_index < index:  # batches of this stream other ranks/workers take
            stream.next_rows()
        return k, stream, stream.next_rows()


@dataclasses.dataclass(frozen=True)
class StepBalance:
    """How the train stream balances each optimizer step (data.dp_balance): the row cost, the
    global micro-batches of one step (data-parallel ranks x accumulation) and the global
    micro-batch where a step began (0, or where a resume changed the global batch)."""

    cost: RowCost
    micro_batches_per_step: int
    anchor: int = 0

    def step_start(self, micro_batch: int) -> int:
        """The first global micro-batch of the step that holds ``micro_batch``."""
        steps = (micro_batch - self.anchor) // self.micro_batches_per_step
        return self.anchor + steps * self.micro_batches_per_step


@dataclasses.dataclass
class BalancedStep:
    """One optimizer step read whole: its rows in global order, the plan, and every stream's
    position after it."""

    start: int
    rows: list[PackedRow]
    plan: StepPlan
    stream: BatchStream  # collates the step's rows (one stage)
    positions: tuple[tuple[int, StreamPosition], ...]


class BalancedSteps:
    """A rank's micro-batches under data.dp_balance: every rank reads every row of the step,
    computes the same plan (longctx.data.dp_balance.balance_step on the rows' costs), and
    trains its slots; in round m of the step rank r trains ``plan.slots[r, m]``."""

    def __init__(self, dataset: TrainStream, reader: StreamReader) -> None:
        self.dataset, self.reader = dataset, reader
        self.step: BalancedStep | None = None

    def batch(self, first: int) -> StreamBatch:
        d = self.dataset
        start = d.balance.step_start(first)
        if self.step is None or self.step.start != start:
            self.step = self.read_step(start)
        round_, rest = divmod(first - start, d.world_size)
        if rest or first < d.balance.anchor:
            raise RuntimeError(
                f"the round from global micro-batch {first} does not start a round of the "
                f"balanced step from {start} on {d.world_size} ranks: the resume state is "
                "inconsistent (a checkpoint inside a step, resumed on another number of ranks?)"
            )
        rows = [self.step.rows[i] for i in self.step.plan.slots[d.rank, round_]]
        last = round_ + 1 == self.step.plan.slots.shape[1]
        stage = self.step.stream.stage
        origin = BatchOrigin(first, d.world_size, stage, self.step.positions if last else ())
        return StreamBatch.of_rows(self.step.stream.collate(rows), rows, origin)

    def read_step(self, start: int) -> BalancedStep:
        d, count = self.dataset, self.dataset.balance.micro_batches_per_step
        rows: list[PackedRow] = []
        positions: dict[int, StreamPosition] = {}
        stages = set()
        for u in range(start, start + count):
            k, stream, micro = self.reader.read(u)
            rows += micro
            positions[k], stages = stream.position(), stages | {stream.stage}
        if len(stages) > 1:
            raise RuntimeError(
                f"the step from global micro-batch {start} spans stages {sorted(stages)}: "
                "stages change only at step boundaries"
            )
        seq_lens = pad_lengths([row.seq_lens for row in rows])
        costs = d.balance.cost.costs(seq_lens, document_mask=stream.config.document_mask)
        plan = balance_step(
            costs, d.world_size, count // d.world_size, stream.config.micro_batch_size
        )
        return BalancedStep(start, rows, plan, stream, tuple(sorted(positions.items())))


def pad_lengths(seq_lens: list[np.ndarray]) -> np.ndarray:
    """[rows, S] segment lengths, zero padded (PackedBatch.seq_lens' layout)."""
    out = np.zeros((len(seq_lens), max(len(n) for n in seq_lens)), dtype=np.int64)
    for i, n in enumerate(seq_lens):
        out[i, : len(n)] = n
    return out


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


@dataclasses.dataclass
class Progress:
    """The data state: global micro-batches consumed and each stream's position after them."""

    micro_batches: int = 0  # global micro-batches the training loops of all ranks have taken
    positions: dict[int, StreamPosition] = dataclasses.field(default_factory=dict)
    counted_by_trainer: bool = False

    def record(self, batch: PackedBatch) -> None:
        if not isinstance(batch, StreamBatch) or batch.origin is None:
            return  # a validation batch
        first, ranks, _, positions = batch.origin
        if first != self.micro_batches:
            raise RuntimeError(
                f"a train batch of the round from global micro-batch {first} arrived, expected "
                f"the round from {self.micro_batches}: the batch order is broken (was the "
                "iterator shared?)"
            )
        self.positions.update(positions)
        self.micro_batches = first + ranks


def check_state_version(state: dict) -> None:
    """A data state this version can continue; one from before elastic resume is refused."""
    version = state.get("version")
    if version == STATE_VERSION:
        return
    missing = [k for k in ("rows_consumed", "streams") if k not in state]
    raise LongctxError(
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
    furthest = lambda p: (StreamPosition(*p).stage, p[0])  # noqa: E731  (stage, batches)
    for state in states:
        for k, position in state["streams"].items():
            if k not in streams or furthest(position) > furthest(streams[k]):
                streams[k] = list(position)
    return {**first, "streams": dict(sorted(streams.items()))}
