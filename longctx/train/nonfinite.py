"""A step whose loss or gradient norm is NaN or infinite is never applied.

One such step would write NaN into every weight and AdamW moment, and every checkpoint after it
would hold them. The step's gradients are dropped instead, and the run stops with a message
naming the step, so every checkpoint holds a finite state; the run folder keeps what it logged
(and the message says whether a checkpoint was written). ``optim.skip_nonfinite=N``
lets a run skip up to N such steps in total over its life (counted across resumes, as the
checkpoint records the count) before it stops: a skipped step consumes its batch, applies
nothing, and does not count towards ``trainer.max_steps`` or the lr schedule.
"""

from __future__ import annotations

import dataclasses
import math

from longctx.errors import LongctxError


class NonFiniteStep(ValueError):
    """A non-finite loss or gradient norm, beyond what ``optim.skip_nonfinite`` allows: a
    finding about the run, not a refusal of its input (train.py names it where it catches).
    ``kept``: what the stopped run left (its checkpoints, or only its metrics), said by whoever
    knows the run folder (longctx.train.app)."""

    def __init__(self, what: str, advice: str) -> None:
        super().__init__(what, advice)
        self.what, self.advice, self.kept = what, advice, ""

    def __str__(self) -> str:
        return "; ".join(part for part in (self.what, self.kept, self.advice) if part)


@dataclasses.dataclass
class NonFiniteGuard:
    allowed: int = 0  # optim.skip_nonfinite: steps a run may skip in total
    skipped: int = 0  # skipped so far, over the run's life

    def __post_init__(self) -> None:
        if isinstance(self.allowed, bool) or not isinstance(self.allowed, int) or self.allowed < 0:
            raise LongctxError(
                f"optim.skip_nonfinite={self.allowed!r}; expected a whole number >= 0 (the "
                "non-finite steps a run may skip before it stops)"
            )

    def check(self, step: int, loss: float, grad_norm: float) -> str | None:
        """None for a finite step (apply it); a line to log for a step to skip; raises
        NonFiniteStep when the run must stop. ``step``: the optimizer step it would be."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return None
        what = f"step {step}: loss {loss}, gradient norm {grad_norm}"
        if self.skipped < self.allowed:
            self.skipped += 1
            return (
                f"{what}: not finite, skipped without an update ({self.skipped} of "
                f"optim.skip_nonfinite={self.allowed})"
            )
        allowance = (
            f"after skipping {self.skipped} (optim.skip_nonfinite={self.allowed})"
            if self.allowed
            else "(optim.skip_nonfinite=0)"
        )
        raise NonFiniteStep(
            f"{what}: not finite; the run stops {allowance} without applying it",
            "lower optim.optimizer.lr or optim.grad_clip, check the data at this step, or set "
            "optim.skip_nonfinite=N to skip up to N such steps",
        )
