"""LongCtxDataModule: prepared shards -> packed rows -> PackedBatch, with exact (elastic) resume.

The row order and the resume bookkeeping are Lightning-free (longctx.data.streams, whose
docstring says how the document stream is cut); this module is the glue: shard folders, the
rank topology, DataLoaders, the fixed validation set, and the checkpointed data state.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
import signal
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from longctx.batch import PackedBatch
from longctx.context_shard import data_parallel_rank_and_size
from longctx.data.config import DataConfig
from longctx.data.dp_balance import RowCost
from longctx.data.packing import PackedRow, collate_rows
from longctx.data.run_tokenizer import data_folders
from longctx.data.shards import Manifest, ShardSet, load_manifest
from longctx.data.streams import (
    STATE_VERSION,
    FixedBatches,
    Progress,
    StageSchedule,
    StepBalance,
    StreamPosition,
    TrainStream,
    check_state_version,
    long_token_share,
    merge_rank_states,
    packer_for,
    slot_probabilities,
    upsampled_slots,
)
from longctx.data.tokenizer import data_tokenizer, load_tokenizer, packing_bos_id
from longctx.errors import LongctxError
from longctx.synthetic.mqar import answer_keys

# fingerprint keys added after checkpoints first carried one, as those checkpoints trained
FINGERPRINT_BEFORE = {"dp_balance": False}


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

    def __init__(self, dataset: TrainStream, progress: Progress, balance, **kwargs) -> None:
        """``balance``: the datamodule's step_balance, read when an iterator starts."""
        super().__init__(dataset, batch_size=None, collate_fn=_identity, **kwargs)
        self.progress, self.balance = progress, balance

    def __iter__(self):
        self.dataset.start = self.progress.micro_batches
        self.dataset.positions = dict(self.progress.positions)
        self.dataset.balance = self.balance()
        for batch in super().__iter__():
            if not self.progress.counted_by_trainer:
                self.progress.record(batch)
            yield batch


class LongCtxDataModule(L.LightningDataModule):
    """Packed PackedBatch streams from prepared shard folders (or the embedded corpus)."""

    def __init__(
        self,
        config: DataConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        context_parallel: int = 1,
        accumulate_grad_batches: int = 1,
        row_cost: RowCost | None = None,
    ) -> None:
        """rank / world_size: data-parallel ones, fixed here (tests) or taken from the trainer;
        context_parallel: ranks sharing each row, which all read the same batches;
        accumulate_grad_batches: micro-batches per rank and step (where data.stages change, and
        the steps data.dp_balance balances); row_cost: what a row costs, for data.dp_balance
        (longctx.planner.dp_balance.row_cost_for: the planner's step-time model)."""
        super().__init__()
        if config.dp_balance and row_cost is None:
            raise LongctxError(
                "data.dp_balance=true and no row cost was given; expected the planner's "
                "(longctx.planner.dp_balance.row_cost_for), as the training app passes it"
            )
        self.config = config
        self._rank, self._world = rank, world_size
        self.context_parallel = context_parallel
        self.accumulate_grad_batches = accumulate_grad_batches
        self.row_cost = row_cost
        # global micro-batches per optimizer step and where its steps began: a resume keeps
        # the checkpoint's (elastic resume keeps the global batch; load_state_dict)
        self._step_micro_batches: int | None = None
        self._step_anchor = 0
        self._progress = Progress()
        self._folders: list[Path] | None = None
        self._manifests: list[Manifest] | None = None
        self._train: list[ShardSet] | None = None

    def prepare_data(self) -> None:
        for folder in self.folders():  # a bad manifest fails here, named as itself
            load_manifest(folder)

    def setup(self, stage: str | None = None) -> None:
        self._open()
        self._progress.counted_by_trainer = self.trainer is not None
        if self.config.length_upsampling is not None and stage in (None, "fit"):
            self._report_long_token_share()

    def _report_long_token_share(self) -> None:
        """Print (rank 0) and log the token share of long documents, before and after."""
        spec = self.config.length_upsampling
        lengths = [s.document_lengths() for s in self._open()]
        every_document_once = [np.arange(len(n)) for n in lengths]
        before = long_token_share(self._weights(), lengths, every_document_once, spec.min_tokens)
        probabilities, slots = self._mixing()
        after = long_token_share(probabilities, lengths, slots, spec.min_tokens)
        rank_zero_info(
            f"length upsampling: documents of >= {spec.min_tokens} tokens drawn {spec.factor}x "
            f"as often ({'per source' if spec.per_source else 'globally'}): their token share "
            f"{before:.1%} -> {after:.1%}"
        )
        for logger in self.trainer.loggers if self.trainer is not None else []:
            logger.log_metrics({"data/long_token_share": after}, step=0)

    def folders(self) -> list[Path]:
        """The prepared folders read (longctx.data.run_tokenizer.data_folders)."""
        if self._folders is None:
            self._folders = data_folders(self.config)
        return self._folders

    def _open(self) -> list[ShardSet]:
        if self._train is None:
            folders = self.folders()
            manifests = [load_manifest(f) for f in folders]
            spec = data_tokenizer(self.config.tokenizer, folders, manifests)  # the run's
            bos_id = packing_bos_id(self.config.add_bos, spec)
            keys = answer_keys(self.config.loss_tokens, spec)
            self.config = dataclasses.replace(self.config, bos_id=bos_id, answer_keys=keys)
            train = [ShardSet(f, "train") for f in folders]
            for folder, shard_set in zip(folders, train, strict=True):
                if shard_set.num_documents == 0:
                    raise LongctxError(
                        f"{folder} has no training documents; expected a non-empty corpus"
                    )
            self._manifests, self._train = manifests, train
        return self._train

    def tokenizer(self):
        """The run's tokenizer: its data's (longctx.data.run_tokenizer)."""
        return load_tokenizer(self.manifest.tokenizer)

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

    def check_vocab(self, model_vocab_size: int) -> None:
        if self.vocab_size > model_vocab_size:
            raise LongctxError(
                f"the corpus in {self.folders()[0]} has vocab_size {self.vocab_size} "
                f"(tokenizer {self.manifest.tokenizer}), more than the model's "
                f"{model_vocab_size}; expected a model vocabulary >= the tokenizer's"
            )

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
            raise LongctxError(f"rank={rank}, world_size={world}; expected 0 <= rank < world_size")
        return rank, world

    def batches_per_epoch(self) -> int:
        tokens = sum(s.num_tokens for s in self._open())
        per_batch = self.world_size * self.config.micro_batch_size * self.config.seq_len
        if tokens < per_batch:
            raise LongctxError(
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
                raise LongctxError(
                    f"{folder} has {shard_set.num_documents} training documents, fewer than "
                    f"the {num_streams} streams (DataConfig.num_streams); expected at least one "
                    "per stream"
                )
        _warn_shared_streams(num_streams, world, self.config.num_workers)
        probabilities, slots = self._mixing()
        return TrainStream(
            sources,
            probabilities,
            self.config,
            self.pad_id,
            rank,
            world,
            self.batches_per_epoch(),
            self.schedule(),
            slots,
            self.step_balance(),
        )

    def micro_batches_per_step(self) -> int:
        """Global micro-batches of one optimizer step: ranks x accumulation, the checkpoint's
        after a resume (kept as the module keeps its global batch: longctx.distributed.elastic)."""
        return self._step_micro_batches or self.accumulate_grad_batches * self.world_size

    def step_balance(self) -> StepBalance | None:
        """How the train stream balances each step (data.dp_balance), or None."""
        if not self.config.dp_balance:
            return None
        return StepBalance(self.row_cost, self.micro_batches_per_step(), self._step_anchor)

    def schedule(self) -> StageSchedule:
        """Where each stage starts, in global micro-batches (all ranks', accumulation's)."""
        return StageSchedule(self.config, self.accumulate_grad_batches * self.world_size)

    def _weights(self) -> np.ndarray:
        weights = np.asarray(self.config.weights or [1.0] * len(self._open()), dtype=np.float64)
        return weights / weights.sum()

    def _mixing(self) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """(the chance of each source per document slot, each source's epoch slots or None)."""
        spec = self.config.length_upsampling
        if spec is None:
            return self._weights(), None
        lengths = [s.document_lengths() for s in self._open()]
        longest = max(int(n.max()) for n in lengths)
        if spec.min_tokens > longest:
            raise LongctxError(
                f"DataConfig.length_upsampling.min_tokens={spec.min_tokens} is above every "
                f"training document (the longest has {longest} tokens, in "
                f"{[str(f) for f in self.folders()]}); expected a threshold that some "
                "documents reach"
            )
        slots = [upsampled_slots(n, spec.min_tokens, spec.factor) for n in lengths]
        return slot_probabilities(self._weights(), lengths, slots, spec.per_source), slots

    def train_dataloader(self) -> DataLoader:
        workers = self.config.num_workers
        return _TrainLoader(
            self.train_dataset(),
            self._progress,
            self.step_balance,
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
        self._open()  # the manifest's pad and BOS
        folder = self.folders()[0]
        val = ShardSet(folder, "val")
        packer = packer_for(self.config, self.pad_id, self.config.seed)
        docs = (val.document(i) for i in range(val.num_documents))
        rows = list(itertools.islice(packer.pack(docs), self.config.val_rows))
        if len(rows) < self.config.val_rows:
            raise LongctxError(
                f"the val split of {folder} packs into {len(rows)} rows of {self.config.seq_len}"
                f" tokens, fewer than val_rows={self.config.val_rows}; lower val_rows or "
                "prepare with a larger val fraction"
            )
        return rows

    def val_documents(self, limit: int | None) -> list[np.ndarray]:
        """The first ``limit`` documents (None: all) of the first folder's val split: the
        held-out documents every arm is scored on (longctx.eval.documents)."""
        folder = self.folders()[0]
        val = ShardSet(folder, "val")
        if limit is not None and limit > val.num_documents:
            raise LongctxError(
                f"num_documents={limit}: the val split of {folder} has {val.num_documents} "
                f"documents; ask for at most {val.num_documents}, or null for all of them"
            )
        return [val.document(i) for i in range(val.num_documents if limit is None else limit)]

    def _validation_batches(self, world: int) -> list[list[PackedBatch]]:
        """Per-rank batches of the fixed validation rows (rows r::world go to rank r)."""
        if self.config.val_rows % world:
            raise LongctxError(
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

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if self.trainer is not None and self.trainer.training:
            self._progress.record(batch)
        return batch

    def state_dict(self) -> dict:
        """Global rows consumed and every stream's position, merged over all ranks."""
        local = {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint(),
            "rows_consumed": self.schedule().rows_before(self._progress.micro_batches),
            "streams": {int(k): list(p) for k, p in self._progress.positions.items()},
            # where the optimizer steps fall, which data.dp_balance balances
            "micro_batches_per_step": self.micro_batches_per_step(),
            "step_anchor": self._step_anchor,
        }
        states = [local]
        if self._gathers():  # every process; context-parallel ranks hold equal copies
            states = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, local)
        return merge_rank_states(states)

    def load_state_dict(self, state: dict) -> None:
        check_state_version(state)
        mine, saved = self._fingerprint(), {**FINGERPRINT_BEFORE, **state["fingerprint"]}
        changed = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
        if set(changed) == {"stage_starts"}:
            raise LongctxError(stage_starts_moved(saved, self.schedule().starts))
        if changed:
            hint = (
                f"; data.num_streams=null follows num_workers: set data.num_streams="
                f"{saved['num_streams']} to keep the row order"
                if "num_streams" in changed and self.config.num_streams is None
                else ""
            )
            listed = "; ".join(f"data.{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise LongctxError(
                f"cannot resume the data stream exactly: settings changed since the "
                f"checkpoint (saved -> now): {listed}{hint}"
            )
        self._progress.micro_batches = self.schedule().micro_batches_for(
            int(state["rows_consumed"])
        )
        self._progress.positions = {int(k): StreamPosition(*p) for k, p in state["streams"].items()}
        self._keep_steps(state.get("micro_batches_per_step"), int(state.get("step_anchor", 0)))

    def _keep_steps(self, saved: int | None, anchor: int) -> None:
        """The checkpoint's steps: its global micro-batches per step on this many ranks (the
        nearest whole accumulation, as the module keeps the global batch), where they began; a
        changed global batch begins its steps here."""
        if saved is None:  # written before data.dp_balance: the configured steps, from 0
            return
        world = self.world_size
        self._step_micro_batches = max(1, round(saved / world)) * world
        same = self._step_micro_batches == saved
        self._step_anchor = anchor if same else self._progress.micro_batches

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
            "stages": [dataclasses.asdict(s) for s in c.stages] if c.stages else None,
            # where the stages change in micro-batches: on another number of ranks they would
            # not fall on the same rows
            "stage_starts": self.schedule().starts if c.stages else None,
            "length_upsampling": (
                dataclasses.asdict(c.length_upsampling) if c.length_upsampling else None
            ),
            # which slot of a step trains each row (stream positions are kept per step with it)
            "dp_balance": c.dp_balance,
        }

    def _load_manifests(self) -> list[Manifest]:
        self._open()
        return self._manifests


def stage_starts_moved(saved: dict, starts: list[int]) -> str:
    """Why a stages run cannot resume with another micro-batches-per-step (ranks x
    accumulation): its stage boundaries, counted in micro-batches, would fall on other rows."""
    until = saved["stages"][0]["until_step"]
    before, now = saved["stage_starts"][1] // until, starts[1] // until
    return (
        f"cannot resume this data.stages run with {now} micro-batches per optimizer step "
        f"(data-parallel ranks x optim.accumulate_grad_batches); the checkpoint was written "
        f"with {before}, and its stages change at those micro-batches "
        f"({saved['stage_starts'][1:]}, here {starts[1:]}). Resume with ranks x accumulation = "
        f"{before} (e.g. the same trainer.devices and optim.accumulate_grad_batches)"
    )


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
