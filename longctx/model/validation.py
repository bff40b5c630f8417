"""Field checks shared by the typed configs (the model's, the HF adapter's, the planner's): each
names the field and what it expected.

A number is finite or refused: NaN compares false with everything, so a bare ``value <= 0``
lets it through, and a NaN RoPE base or scaling factor trains to a NaN checkpoint.
"""

from __future__ import annotations

import math
from typing import Any

from longctx.errors import LongctxError


def require_number(
    name: str, value: Any, error: type[LongctxError] = LongctxError, meaning: str = ""
) -> None:
    """A finite int or float (not a bool), or ``error`` naming the field (and, when given, what
    it is: ``meaning``, e.g. "the model FLOPs utilisation")."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise error(f"{name}={value!r}{_about(meaning)}; expected a finite number")


def require_positive(
    name: str, value: Any, error: type[LongctxError] = LongctxError, meaning: str = ""
) -> None:
    """A finite positive number, or ``error`` naming the field (the planner raises PlanError)."""
    require_number(name, value, error, meaning)
    if value <= 0:
        raise error(f"{name}={value!r}{_about(meaning)}; expected a positive number")


def _about(meaning: str) -> str:
    return f": {meaning}" if meaning else ""


def require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LongctxError(f"{name}={value!r}; expected a positive int")
