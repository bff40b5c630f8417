"""Evaluation: loss by position, long-range probes."""

from longctx.eval.passkey import accuracy_table, make_probes, score_probes
from longctx.eval.position_loss import PositionLoss, bucket_of, bucket_starts

__all__ = [
    "PositionLoss",
    "accuracy_table",
    "bucket_of",
    "bucket_starts",
    "make_probes",
    "score_probes",
]
