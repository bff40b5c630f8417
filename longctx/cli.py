"""Command lines: one error style, and progress bars for long work.

Errors: ``error: <what> (<value>); <what to do>``, exit 2.

A user's mistake (a missing file, a bad value, a refused config) is one line on stderr, not a
traceback: the message already names the value and what was expected. ``LONGCTX_DEBUG=1`` shows
the traceback too, for a bug report. longctx's refusals raise ``longctx.errors.LongctxError``;
the commands catch it and OSError (a path) and nothing broader, so any other error (a plain
ValueError from a bug in longctx or a library) keeps its traceback and exits 1.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from tqdm import tqdm

from longctx.errors import LongctxError

# What a user's input can raise: longctx's own refusals (LongctxError and its subclasses), and
# OSError for paths (FileExistsError / FileNotFoundError, PermissionError for a folder they cannot
# write). The one definition: a command that reports another type in one line adds it where it
# catches (train.py: NonFiniteStep, a run that diverged; longctx.hf.verify: VerifyFailed;
# longctx.data.prepare: a failed SLURM task; longctx.probe.cli: Hydra's config errors), rather
# than keeping a tuple of its own.
USER_ERRORS: tuple[type[BaseException], ...] = (LongctxError, OSError)

T = TypeVar("T")


def error_line(err: BaseException) -> str:
    """The one line for ``err``: its message, prefixed with ``error: `` once."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if text.startswith("error: ") else f"error: {text}"


def debug() -> bool:
    return os.environ.get("LONGCTX_DEBUG", "") not in ("", "0")


def exit_on_user_error(err: BaseException) -> None:
    """Print ``err`` as one line and exit 2 (with its traceback under LONGCTX_DEBUG=1)."""
    if debug():
        import traceback

        traceback.print_exception(err, file=sys.stderr)
    print(error_line(err), file=sys.stderr, flush=True)
    raise SystemExit(2) from None


def command(
    main: Callable[..., T], errors: tuple[type[BaseException], ...] = USER_ERRORS
) -> Callable[..., T]:
    """Wrap a CLI's ``main`` so that ``errors`` end it with one line and exit 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> T:
        try:
            return main(*args, **kwargs)
        except errors as err:
            exit_on_user_error(err)
            raise  # unreachable: exit_on_user_error raises SystemExit

    return wrapped


# Progress for long command-line work (export, prepare, convert): a tqdm bar with counts and
# rates on a terminal, nothing when stdout is a file or a pipe (a log, CI, a test).
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
