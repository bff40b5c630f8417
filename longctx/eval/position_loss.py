"""Loss by position bucket: does the model use long context?

Buckets are log-spaced: bucket 0 is position 0 and bucket k >= 1 covers [2^(k-1), 2^k), so a row of
L tokens has 1 + ceil(log2 L) buckets. Two positions are tracked for every target token: its
absolute position in the row, and its position inside its document. The document position comes
from EOS tokens when ``eos_id`` is known (documents end with EOS in every packer), so it is the
same in every ablation arm — even the no-masking arm, whose batch has one segment per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longctx.batch import IGNORE_INDEX, PackedBatch


def bucket_of(positions: Tensor) -> Tensor:
    """Bucket index of each position: 0 for 0, else floor(log2(p)) + 1."""
    p = positions.long().clamp(min=0)
    return torch.where(p > 0, torch.log2(p.clamp(min=1).double()).floor().long() + 1, 0)


def bucket_starts(seq_len: int) -> list[int]:
    """First position of every bucket that a row of seq_len tokens reaches."""
    n = int(bucket_of(torch.tensor([max(seq_len - 1, 0)]))) + 1
    return [0] + [2 ** (k - 1) for k in range(1, n)]


def positions_in_document(batch: PackedBatch, eos_id: int | None) -> Tensor:
    """[B, L] distance of each token from the start of its document (within the row)."""
    if eos_id is None:  # fall back to the batch's own segments
        starts = batch.cu_seqlens[:-1].long()
        flat = torch.arange(batch.tokens.numel(), device=batch.tokens.device)
        seg = torch.bucketize(flat, starts, right=True) - 1
        return (flat - starts[seg]).view(batch.shape)
    length = batch.shape[1]
    idx = torch.arange(length, device=batch.tokens.device).expand(batch.shape)
    # a document starts at the row start or right after an EOS
    after_eos = torch.nn.functional.pad(batch.tokens[:, :-1] == eos_id, (1, 0), value=True)
    doc_start = torch.where(after_eos, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - doc_start


class PositionLoss:
    """Accumulates target-token loss sums and counts by absolute and in-document bucket."""

    def __init__(self, seq_len: int, eos_id: int | None = None) -> None:
        self.starts = bucket_starts(seq_len)
        self.eos_id = eos_id
        n = len(self.starts)
        self.sums = torch.zeros(2, n, dtype=torch.float64)  # [absolute, in-document]
        self.counts = torch.zeros(2, n, dtype=torch.float64)

    def update(self, token_loss: Tensor, batch: PackedBatch) -> None:
        """token_loss: [B, L] per-token loss, ignored where labels == -100."""
        mask = (batch.labels != IGNORE_INDEX).flatten().cpu()
        loss = token_loss.detach().double().flatten().cpu()[mask]
        absolute = torch.arange(batch.shape[1]).expand(batch.shape).flatten()[mask]
        in_doc = positions_in_document(batch, self.eos_id).flatten().cpu()[mask]
        n = len(self.starts)
        for row, positions in enumerate((absolute, in_doc)):
            buckets = bucket_of(positions).clamp(max=n - 1)
            self.sums[row] += torch.bincount(buckets, weights=loss, minlength=n)
            self.counts[row] += torch.bincount(buckets, minlength=n).double()

    def all_reduce(self, strategy) -> None:
        """Sum over ranks (a Lightning strategy, or None for one process)."""
        if strategy is None or getattr(strategy, "world_size", 1) == 1:
            return
        both = strategy.reduce(
            torch.stack([self.sums, self.counts]).to(strategy.root_device), reduce_op="sum"
        )
        self.sums, self.counts = both[0].cpu(), both[1].cpu()

    def mean_loss(self) -> float:
        return float(self.sums[0].sum() / self.counts[0].sum().clamp(min=1))

    def bucket_means(self) -> dict[str, list[float]]:
        means = (self.sums / self.counts.clamp(min=1)).where(self.counts > 0, torch.nan)
        return {"absolute": means[0].tolist(), "in_document": means[1].tolist()}

    def bucket_metrics(self, prefix: str) -> dict[str, float]:
        """Flat metric names, e.g. val/loss_by_abs_pos/1024, skipping empty buckets."""
        out = {}
        for kind, row in (("abs_pos", 0), ("doc_pos", 1)):
            pairs = zip(self.starts, self.counts[row], self.sums[row], strict=True)
            for start, count, total in pairs:
                if count > 0:
                    out[f"{prefix}/loss_by_{kind}/{start}"] = float(total / count)
        return out

    def records(self) -> list[dict]:
        """Tidy rows: kind ("absolute" | "in_document"), bucket start and end, loss, tokens."""
        ends = self.starts[1:] + [None]
        rows = []
        for kind, means in self.bucket_means().items():
            counts = self.counts[0 if kind == "absolute" else 1].tolist()
            for start, end, loss, count in zip(self.starts, ends, means, counts, strict=True):
                rows.append(
                    {
                        "kind": kind,
                        "bucket_start": start,
                        "bucket_end": end,
                        "loss": loss,
                        "tokens": int(count),
                    }
                )
        return rows
