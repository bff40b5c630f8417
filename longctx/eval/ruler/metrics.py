"""RULER's metrics: the per-instance score in [0, 1] of a generated text against the references."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from longctx.eval.ruler.instances import RulerInputError


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for niah, vt, cwe and fwe: the fraction of the references that occur in
    the prediction, case-insensitively (a substring anywhere counts, any order)."""
    found = [ref.lower() in prediction.lower() for ref in references]
    return sum(found) / len(found)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's metric for qa: 1 if any reference occurs in the prediction (case-insensitive)."""
    return float(any(ref.lower() in prediction.lower() for ref in references))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def ruler_metric(name: str, prediction: str, references: Sequence[str]) -> float:
    """The per-instance score in [0, 1] of RULER's metric ``name``."""
    if name not in METRICS:
        raise RulerInputError(f"unknown metric ({name!r}); expected one of {', '.join(METRICS)}")
    if not references:
        raise RulerInputError("an instance without references cannot be scored; expected >= 1")
    return METRICS[name](prediction, references)
