"""Field checks shared by the model's typed configs: each names the field and what it expected.

A number is finite or refused: NaN compares false with everything, so a bare ``value <= 0``
lets it through, and a NaN RoPE base or scaling factor trains to a NaN checkpoint.
"""

from __future__ import annotations

import math
from typing import Any


def require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}; expected a finite number")


def require_positive(name: str, value: Any) -> None:
    require_number(name, value)
    if value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive number")


def require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive int")
