"""How a run is laid out over ranks, and the rows of documents the plan is computed for."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from longctx.cp_balance import DEFAULT_BALANCE, check_balance
from longctx.errors import LongctxError
from longctx.planner.settings import PRECISIONS, PlanError

LENGTH_SAMPLE_ROWS = 128  # rows sampled from a stated length distribution (seeded)


@dataclass(frozen=True)
class RunLayout:
    """How a run is laid out over ranks, and what each rank computes."""

    seq_len: int
    micro_batch_size: int = 1
    num_nodes: int = 1
    devices: int = 1  # per node
    context_parallel: int = 1
    context_parallel_rounds: int = 1
    context_parallel_balance: str = DEFAULT_BALANCE
    fsdp: bool = False  # FSDP2 over the world; otherwise replicated (DDP / one process)
    precision: str = "fp32"  # fp32 | bf16-mixed (autocast, fp32 residual) | bf16 (FSDP2 bf16)
    activation_checkpointing: bool = False
    attn_backend: str = "sdpa"  # resolved: flash | flex | sdpa | eager
    accumulate_grad_batches: int = 1
    max_steps: int = 1
    # a row's document lengths (cycled to fill a row); empty = one document per row (worst case)
    doc_lengths: tuple[int, ...] = ()
    # a stated length distribution instead: lognormal (median, sigma) documents packed into
    # rows in order, the last one cut at the row's end (rows are sampled: LENGTH_SAMPLE_ROWS)
    doc_length_lognormal: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlanError(f"precision={self.precision!r}; expected one of {PRECISIONS}")
        for name in ("seq_len", "micro_batch_size", "num_nodes", "devices", "context_parallel"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)}; expected >= 1")
        try:
            check_balance(self.context_parallel_balance, self.context_parallel_rounds)
        except LongctxError as err:
            raise PlanError(str(err)) from err
        if self.doc_length_lognormal is not None:
            median, sigma = self.doc_length_lognormal
            if not (median >= 1 and 0 <= sigma < 10):  # also refuses NaN
                raise PlanError(
                    f"doc_length_lognormal=({median}, {sigma}); expected a median >= 1 token "
                    "and 0 <= sigma < 10"
                )

    @property
    def world(self) -> int:
        return self.num_nodes * self.devices

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one micro-batch on one rank: its rows, or its share of them under CP."""
        return self.micro_batch_size * self.seq_len // self.context_parallel

    @property
    def residual_bytes(self) -> int:
        return 2 if self.precision == "bf16" else 4

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@functools.cache
def layout_rows(layout: RunLayout) -> tuple[np.ndarray, ...]:
    """The rows the plan is computed for: the one that ``doc_lengths`` gives, or
    LENGTH_SAMPLE_ROWS drawn (seeded) from ``doc_length_lognormal``."""
    if layout.doc_length_lognormal is None:
        return (np.array(row_lengths(layout), dtype=np.int64),)
    rng = np.random.default_rng(0)
    median, sigma = layout.doc_length_lognormal
    return tuple(
        lognormal_row(layout.seq_len, median, sigma, rng) for _ in range(LENGTH_SAMPLE_ROWS)
    )


def row_lengths(layout: RunLayout) -> list[int]:
    """One row's document lengths: ``doc_lengths`` cycled and cut to fill seq_len."""
    if not layout.doc_lengths:
        return [layout.seq_len]
    lens, total, i = [], 0, 0
    while total < layout.seq_len:
        n = min(layout.doc_lengths[i % len(layout.doc_lengths)], layout.seq_len - total)
        lens.append(n)
        total, i = total + n, i + 1
    return lens


def lognormal_row(length: int, median: float, sigma: float, rng) -> np.ndarray:
    """One row of documents of lognormal lengths (at least 1 token), the last cut to fit."""
    lens, total = [], 0
    while total < length:
        n = max(1, min(int(median * math.exp(sigma * rng.standard_normal())), length - total))
        lens.append(n)
        total += n
    return np.array(lens, dtype=np.int64)


def size_biased_mean(layout: RunLayout) -> float:
    """Mean length of the document a random token sits in (sum n^2 / sum n)."""
    lens = np.concatenate(layout_rows(layout))
    return float((lens.astype(np.float64) ** 2).sum() / lens.sum())


def documents_note(layout: RunLayout) -> str:
    if layout.doc_length_lognormal is not None:
        median, sigma = layout.doc_length_lognormal
        return f"lognormal documents, median {median:,.0f}, sigma {sigma}"
    if not layout.doc_lengths:
        return "one document per row (worst case)"
    n = len(layout_rows(layout)[0])
    return f"{n} documents per row (size-biased mean {size_biased_mean(layout):,.0f})"
