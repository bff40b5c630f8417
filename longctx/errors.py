"""The one base of longctx's refusals, and the one test of a number that a setting may hold.

Every refusal of a user's input (a bad value, a refused config, a missing or foreign file)
raises a ``LongctxError``; the command lines catch it (and OSError, for paths) and print one
line. Anything else is a bug and keeps its traceback: a check that only longctx's own code can
fail (an internal invariant) raises a plain ValueError. It subclasses ValueError so that callers
catching ValueError around a bad value keep working.

The exception classes of longctx that are not refusals, and why (tests/unit/test_errors.py
holds that every other one is a LongctxError):

- ``longctx.synthetic.pieces.DoesNotFit`` and its ``longctx.synthetic.pieces.RunsOut``: a
  signal that a task's instance does not fit a length; the callers retry at another length or
  turn it into a refusal that names the task and the length.
- ``longctx.train.callbacks.SweepStopped``: control flow; a signal stopped one arm of a local
  multirun and the arms after it must not start.
- ``longctx.train.nonfinite.NonFiniteStep``: a finding about a run (its loss or gradient went
  non-finite), not about its input; train.py reports it in one line, naming it.
- ``longctx.probe.callback.LeakDetected``: a finding of the leak probe; the run must stop.
- ``longctx.hf.verify.VerifyFailed``: a finding about an export (its logits differ);
  longctx.hf.verify's command line reports it in one line, naming it.
- ``longctx.data.pipeline.PrepareTaskFailed``: a prepare task failed, whatever its error;
  the prepare command line reports it, naming it.
- ``longctx.data.pipeline.SlurmUnreachable``: the environment, not the input: no SLURM
  answers; the prepare command line reports it, naming it.
"""

from __future__ import annotations

import numbers


class LongctxError(ValueError):
    """A refusal that names the value and what was expected."""


def is_number(value) -> bool:
    """A real number a setting may hold (numpy's scalars too), not a bool: ``True`` is an int to
    Python, but a config that says ``true`` where a number belongs is a mistake to refuse."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
