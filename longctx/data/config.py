"""DataConfig: what the data pipeline reads, packs and yields, validated on construction."""

from __future__ import annotations

import dataclasses


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
