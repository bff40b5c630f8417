"""Elastic resume: a run continues on another number of data-parallel ranks with the same
optimizer step.

The data order does not depend on the number of ranks (longctx.data.streams); what a step
trains on is its global batch, micro-batch rows x accumulation x data-parallel ranks. A
checkpoint records it, and a resume on another data-parallel size keeps it by choosing the
accumulation. When no whole accumulation keeps it, the resume is refused with the numbers, unless
the run allows the change (``optim.allow_global_batch_change=true``), which is then logged.
"""

from __future__ import annotations

import dataclasses

from longctx.errors import LongctxError


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """The rows one optimizer step trains on, and how they are split."""

    micro_batch_rows: int
    accumulate_grad_batches: int
    data_parallel_size: int

    @property
    def rows(self) -> int:
        return self.micro_batch_rows * self.accumulate_grad_batches * self.data_parallel_size

    def __str__(self) -> str:
        return (
            f"{self.rows} rows (micro-batch {self.micro_batch_rows} x accumulation "
            f"{self.accumulate_grad_batches} x {self.data_parallel_size} data-parallel ranks)"
        )


def resume_accumulation(
    saved: GlobalBatch,
    micro_batch_rows: int,
    data_parallel_size: int,
    configured: int,
    allow_change: bool,
) -> tuple[int, str | None]:
    """The accumulation a resumed run uses on ``data_parallel_size`` ranks, and a line to log
    when it is not the ``configured`` one or the global batch changes (None otherwise)."""
    per_round = micro_batch_rows * data_parallel_size
    accumulation, rest = divmod(saved.rows, per_round)
    if rest == 0:
        now = GlobalBatch(micro_batch_rows, accumulation, data_parallel_size)
        if accumulation == configured and now == saved:
            return accumulation, None
        return accumulation, (
            f"resume: accumulate_grad_batches {accumulation} (configured {configured}) keeps "
            f"the checkpoint's global batch: {saved} -> {now}"
        )
    if not allow_change:
        raise LongctxError(
            f"cannot keep the checkpoint's global batch of {saved} on {data_parallel_size} "
            f"data-parallel ranks with micro-batch {micro_batch_rows}: {saved.rows} rows is not "
            f"a multiple of {micro_batch_rows} x {data_parallel_size} = {per_round}; resume on "
            f"a data-parallel size that divides {saved.rows // micro_batch_rows}, or set "
            "optim.allow_global_batch_change=true to go on with the nearest global batch"
        )
    now = GlobalBatch(micro_batch_rows, max(1, round(saved.rows / per_round)), data_parallel_size)
    return now.accumulate_grad_batches, (
        f"resume: the global batch changes (optim.allow_global_batch_change=true): {saved} -> {now}"
    )
