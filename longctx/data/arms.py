"""The position ablation's arms: what each (reset_position_ids, document_mask) pair computes.

With RoPE a query-key score depends only on the two tokens' distance. Under document masking both
tokens sit in one document, so reset and continuous positions give the same function up to float
rounding (benchmarks/bench_rope_angles.py measures it). Without the mask they are different models:
continuous positions are classic concatenate-and-chunk, and reset positions let attention cross
documents while positions restart -- relative distances a causal model otherwise never sees.
Every place that names an arm (train.py's first line, the analysis, the notebook) says this.
"""

from __future__ import annotations

# (reset_position_ids, document_mask) in the order tables and figures list them: the masked
# control pair first, then the two unmasked models
ARM_ORDER = [(True, True), (False, True), (False, False), (True, False)]

_LABELS = {
    (True, True): "masked, reset pos",
    (False, True): "masked, continuous pos",
    (False, False): "unmasked, continuous pos",
    (True, False): "unmasked, reset pos",
}

_MEANINGS = {
    (True, True): "each document attends only to itself; with RoPE the same function as "
    "continuous positions up to rounding",
    (False, True): "each document attends only to itself; with RoPE the same function as reset "
    "positions up to rounding (larger angles, rounded less exactly)",
    (False, False): "attention crosses documents at consistent distances: classic "
    "concatenate-and-chunk",
    (True, False): "attention crosses documents while positions restart at each one: distances "
    "a causal model never otherwise sees (the silent-leak configuration)",
}


def arm_label(reset_position_ids: bool, document_mask: bool) -> str:
    """Short name for tables and legends, e.g. 'masked, reset pos'."""
    return _LABELS[bool(reset_position_ids), bool(document_mask)]


def arm_description(reset_position_ids: bool, document_mask: bool) -> str:
    """One line saying what the arm computes (train.py prints it at start)."""
    arm = bool(reset_position_ids), bool(document_mask)
    return (
        f"arm: {_LABELS[arm]} (data.reset_position_ids={arm[0]}, data.document_mask={arm[1]}): "
        f"{_MEANINGS[arm]}"
    )
