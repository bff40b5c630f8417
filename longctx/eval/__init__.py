"""Evaluation: loss by position, long-range probes."""

from longctx.eval.position_loss import PositionLoss, bucket_of, bucket_starts

__all__ = ["PositionLoss", "bucket_of", "bucket_starts"]
