"""DataConfig: what the data pipeline reads, packs and yields, validated on construction."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from longctx.data.tokenizer import TOKENIZER_NAMES
from longctx.errors import LongctxError, is_number
from longctx.synthetic import TaskInputError
from longctx.synthetic.mqar import MqarSpec, MqarVocab
from longctx.synthetic.tasks import check_tasks


@dataclasses.dataclass(frozen=True)
class Stage:
    """Rows of ``seq_len`` tokens, ``micro_batch_size`` per micro-batch, for the optimizer
    steps before ``until_step`` (and from the previous stage's ``until_step`` on)."""

    until_step: int
    seq_len: int
    micro_batch_size: int


@dataclasses.dataclass(frozen=True)
class LengthUpsampling:
    """Documents of at least ``min_tokens`` tokens drawn ``factor`` times as often: each appears
    ``factor`` times in every data epoch of its source. ``per_source``: the sources keep their
    token shares (Fu et al. 2024's per-source upsampling); else long documents gain on every
    source alike and a source rich in them gains share (global upsampling)."""

    min_tokens: int
    factor: int
    per_source: bool = True

    def __post_init__(self) -> None:
        where = "DataConfig.length_upsampling"
        if isinstance(self.factor, bool) or not isinstance(self.factor, int) or self.factor < 1:
            raise LongctxError(
                f"{where}.factor={self.factor!r}; expected a whole number >= 1 (the times a long "
                "document appears in a data epoch; 1 = no upsampling)"
            )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise LongctxError(f"{where}.min_tokens={self.min_tokens!r}; expected an int")
        if self.min_tokens < 1:
            raise LongctxError(f"{where}.min_tokens={self.min_tokens}; expected >= 1")
        if not isinstance(self.per_source, bool):
            raise LongctxError(f"{where}.per_source={self.per_source!r}; expected true or false")


def check_mix_settings(tasks, seed, documents, min_length, max_length) -> list[str]:
    """The task names of a synthesized mix (python -m longctx.data.synthesize), once its
    settings are ones the synthesizer can use (else one line naming the value)."""
    names = check_tasks(tasks, "synthesize")
    for name, value, least in (("seed", seed, 0), ("documents", documents, 1),
                               ("min_length", min_length, 2)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise TaskInputError(f"{name}={value!r}; expected an int >= {least}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < min_length:
        raise TaskInputError(
            f"max_length={max_length!r}; expected an int >= min_length={min_length}"
        )
    return names


def check_counts(documents, seed, val_documents) -> None:
    """An MQAR corpus's document counts and seed are ints: documents >= 1, the others >= 0."""
    for name, value, least in (
        ("documents", documents, 1), ("seed", seed, 0), ("val_documents", val_documents, 0)
    ):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LongctxError(f"{name}={value!r}; expected an int >= {least}")


@dataclasses.dataclass(frozen=True)
class Synthesized:
    """A ``data.shards`` entry named by its settings, not by a folder: long-range documents
    (python -m longctx.data.synthesize, whose options these are), synthesized into the cache on
    first use. The same settings read the same folder; other settings, another one."""

    tasks: tuple[str, ...]
    seed: int = 0
    documents: int = 2000  # per task
    min_length: int = 64
    max_length: int = 1024
    haystack: str = "embedded"  # the embedded corpus's training chapters, noise, or a folder
    tokenizer: str | None = None  # None: the run's (data.tokenizer; the bytes when unset)

    def __post_init__(self) -> None:
        names = check_mix_settings(self.tasks, self.seed, self.documents, self.min_length,
                                   self.max_length)  # fmt: skip
        object.__setattr__(self, "tasks", tuple(names))

    @classmethod
    def from_entry(cls, entry: dict, where: str) -> Synthesized:
        """From a config mapping; an unknown or missing key is refused naming it."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(entry) - set(fields))
        if unknown or "tasks" not in entry:
            what = f"unknown key {unknown[0]!r}" if unknown else "no tasks"
            raise LongctxError(
                f"DataConfig.{where}={entry!r}: {what}; expected a folder, 'embedded', or the "
                f"settings of a synthesized mix ({', '.join(fields)})"
            )
        try:
            return cls(**entry)
        except LongctxError as err:
            raise LongctxError(f"DataConfig.{where}: {err}") from err


@dataclasses.dataclass(frozen=True)
class MqarCorpus:
    """A ``data.shards`` entry ``{mqar: {...}}``: an MQAR corpus (python -m
    longctx.data.mqar_corpus, whose options these are), written into the cache on first use;
    the same settings read the same folder."""

    documents: int
    seed: int = 0
    num_keys: int = 512
    num_values: int = 512
    min_pairs: int = 2
    max_pairs: int = 32
    slot_ratio: float = 1.5
    val_documents: int = 200

    def __post_init__(self) -> None:
        self.spec()
        check_counts(self.documents, self.seed, self.val_documents)

    def spec(self) -> MqarSpec:
        vocab = MqarVocab(self.num_keys, self.num_values)
        return MqarSpec(vocab, self.min_pairs, self.max_pairs, self.slot_ratio)

    @classmethod
    def from_entry(cls, entry: dict, where: str) -> MqarCorpus:
        settings = entry["mqar"]
        fields = [f.name for f in dataclasses.fields(cls)]
        if len(entry) != 1 or not isinstance(settings, dict) or set(settings) - set(fields):
            raise LongctxError(
                f"DataConfig.{where}={entry!r}; expected {{mqar: {{...}}}} with keys among "
                f"{', '.join(fields)}"
            )
        try:
            return cls(**settings)
        except (TypeError, LongctxError) as err:
            raise LongctxError(f"DataConfig.{where}: {err}") from err


LOSS_TOKENS = ("all", "answers")


@dataclasses.dataclass
class DataConfig:
    # prepared folders, the name "embedded" among them standing for the embedded corpus, and
    # synthesized mixes named by their settings (Synthesized); None -> the embedded corpus alone
    shards: list[str | Synthesized | MqarCorpus] | None = None
    weights: list[float] | None = None  # mixing weights, one per folder
    seq_len: int = 2048
    packer: str = "best_fit"  # "concat_chunk" | "best_fit"
    reset_position_ids: bool = True
    document_mask: bool = True  # False = one segment per row: the no-masking ablation
    micro_batch_size: int = 2  # rows per micro-batch
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
    # earlier stages of a growing context (Stage dicts, in step order); from the last one's
    # until_step on, rows are seq_len x micro_batch_size (the run's length, validated at)
    stages: list[Stage] | None = None
    length_upsampling: LengthUpsampling | None = None
    # the tokenizer the embedded corpus is prepared with: None or 'byte' (the bytes), 'llama3'
    # (Llama 3's, the llama3 extra). Prepared folders bring their own (their manifest); when
    # this is set, they must have been prepared with it
    tokenizer: str | None = None
    # <|begin_of_text|>-style BOS before every document when packing. None: the tokenizer's
    # convention -- yes for llama3 (Llama 3 sees BOS first in training and at inference: Meta's
    # and torchtitan's encode(bos=True, eos=True), transformers' and lm-eval's BOS prefix), no
    # for the byte tokenizer (its golden curve) and tokenizer folders
    add_bos: bool | None = None
    # the id packing puts first: set by the datamodule from add_bos and the corpus's tokenizer
    bos_id: int | None = None
    # which targets the loss counts: "all" tokens, or "answers" only (an MQAR corpus: the value
    # after each queried key, as Zoology trains; longctx.data.mqar_corpus)
    loss_tokens: str = "all"
    # the key ids whose queries are answered: set by the datamodule for loss_tokens=answers
    answer_keys: tuple[int, int] | None = None
    # reorder each optimizer step's rows over its (data-parallel rank, micro-batch) slots so the
    # most loaded rank costs as little as found (longctx.data.dp_balance, docs/dp-balance.md):
    # the step trains the same rows; every rank then packs every row of the step
    dp_balance: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.shards, str):  # data.shards=/one/folder: one source, not its letters
            self.shards = [self.shards]
        if self.shards is not None:
            self.shards = [_shard(entry, f"shards[{i}]") for i, entry in enumerate(self.shards)]
        self.stages = _stages(self.stages)
        if self.loss_tokens not in LOSS_TOKENS:
            raise LongctxError(
                f"DataConfig.loss_tokens={self.loss_tokens!r}; expected one of {LOSS_TOKENS}"
            )
        if isinstance(self.length_upsampling, dict):  # Hydra hands nested configs over as dicts
            self.length_upsampling = LengthUpsampling(**self.length_upsampling)
        for name in ("seq_len", "micro_batch_size", "buffer_size", "val_rows", "chunk_documents"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(self.num_workers >= 0, "num_workers", self.num_workers, ">= 0")
        _check_tokenizer_name(self.tokenizer)
        _require(
            self.add_bos in (None, True, False), "add_bos", self.add_bos, "true, false or null"
        )
        _require(self.dp_balance in (True, False), "dp_balance", self.dp_balance, "true or false")
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
                all(is_number(w) and math.isfinite(w) and w >= 0 for w in self.weights)
                and sum(self.weights) > 0,
                "weights",
                self.weights,
                "finite non-negative weights with a positive sum",
            )

    @property
    def effective_streams(self) -> int:
        return self.num_streams or max(1, self.num_workers)

    def stage_configs(self) -> list[DataConfig]:
        """One config per stage (its seq_len and micro_batch_size), the last one this."""
        earlier = [
            dataclasses.replace(
                self, seq_len=s.seq_len, micro_batch_size=s.micro_batch_size, stages=None
            )
            for s in self.stages or []
        ]
        return [*earlier, self]


def _stages(stages: Any) -> list[Stage] | None:
    """Stage entries from Hydra's dicts, checked: positive fields, steps increasing."""
    if stages is None:
        return None
    if isinstance(stages, dict | str) or not hasattr(stages, "__iter__"):
        raise LongctxError(
            f"DataConfig.stages={stages!r}; expected a list of "
            "{until_step, seq_len, micro_batch_size} entries"
        )
    out = []
    for i, entry in enumerate(stages):
        stage = Stage(**entry) if isinstance(entry, dict) else entry
        if not isinstance(stage, Stage):
            raise LongctxError(
                f"DataConfig.stages[{i}]={entry!r}; expected {{until_step, seq_len, "
                "micro_batch_size}"
            )
        for name in ("until_step", "seq_len", "micro_batch_size"):
            value = getattr(stage, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            _require(ok, f"stages[{i}].{name}", value, "an int >= 1")
        if out and stage.until_step <= out[-1].until_step:
            raise LongctxError(
                f"DataConfig.stages[{i}].until_step={stage.until_step}; expected more than "
                f"stages[{i - 1}].until_step={out[-1].until_step} (stages in increasing step order)"
            )
        out.append(stage)
    return out or None


def _shard(entry: Any, where: str) -> str | Synthesized | MqarCorpus:
    """A folder (or 'embedded') as given; a mapping (Hydra's form of a node) as Synthesized."""
    if isinstance(entry, dict) and "mqar" in entry:
        return MqarCorpus.from_entry(entry, where)
    if isinstance(entry, dict):
        return Synthesized.from_entry(entry, where)
    if not isinstance(entry, str | os.PathLike | Synthesized | MqarCorpus):
        raise LongctxError(
            f"DataConfig.{where}={entry!r}; expected a folder, 'embedded', or the settings of a "
            "synthesized mix"
        )
    return entry


def _check_tokenizer_name(name: Any) -> None:
    """A tokenizer name or an existing tokenizer folder (nothing is downloaded)."""
    if name is None or name in TOKENIZER_NAMES:
        return
    if not isinstance(name, str) or not os.path.isdir(name):
        raise LongctxError(
            f"DataConfig.tokenizer={name!r}; expected one of {', '.join(TOKENIZER_NAMES)} or a "
            "local tokenizer folder"
        )


def _require(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise LongctxError(f"DataConfig.{name}={value!r}; expected {expected}")
