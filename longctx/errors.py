"""The one base of longctx's refusals.

Every refusal of a user's input (a bad value, a refused config, a missing or foreign file)
raises a ``LongctxError``; the command lines catch it (and OSError, for paths) and print one
line. Anything else is a bug and keeps its traceback. It subclasses ValueError so that callers
catching ValueError around a bad value keep working."""

from __future__ import annotations


class LongctxError(ValueError):
    """A refusal that names the value and what was expected."""
