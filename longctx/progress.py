"""Progress for long command-line work (export, prepare, convert): a tqdm bar with counts and
rates on a terminal, nothing when stdout is a file or a pipe (a log, CI, a test)."""

from __future__ import annotations

import sys

from tqdm import tqdm


def interactive() -> bool:
    return sys.stdout.isatty()


def bar(total: float | None, desc: str, unit: str = "it", disable: bool = False, **kwargs) -> tqdm:
    """A bar on stdout; disabled (a no-op with the same methods) off a terminal."""
    scale = unit == "B"
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        file=sys.stdout,
        disable=disable or not interactive(),
        dynamic_ncols=True,
        **kwargs,
    )
