"""Field checks shared by the model's typed configs: each names the field and what it expected."""

from __future__ import annotations

from typing import Any


def require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}={value!r}; expected a number")


def require_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive number")


def require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}; expected a positive int")
