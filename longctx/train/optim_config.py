"""OptimConfig: the ``optim`` group typed, validated on construction.

``optim.optimizer`` and ``optim.scheduler`` are Hydra partials (their keys are the optimizer's
and the schedule's own arguments: ``optim.optimizer.lr``, ``optim.scheduler.warmup_steps``);
every other key of the group is a field here, at its default unless conf/optim/ or the command
line sets it (longctx.train.typed_defaults).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from longctx.errors import LongctxError, is_number
from longctx.train.nonfinite import NonFiniteGuard

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    optimizer: OptimizerFactory  # called with the model's param groups
    scheduler: SchedulerFactory | None = None  # called with the optimizer and trainer.max_steps
    # decoupled weight decay, applied to matrices only (not norms or embeddings)
    weight_decay: float = 0.1
    # the gradient norm's bound; None or 0: no clipping
    grad_clip: float | None = 1.0
    # micro-batches per optimizer step; the loss is the token mean over all of them
    accumulate_grad_batches: int = 1
    # a resume on another number of data-parallel ranks keeps the checkpoint's global batch
    # (micro batch x accumulation x ranks) by choosing the accumulation itself; where no whole
    # accumulation keeps it the resume stops, naming the numbers, unless this is true: then it
    # goes on with the nearest global batch and logs the change (longctx.distributed.elastic)
    allow_global_batch_change: bool = False
    # a step whose loss or gradient norm is NaN or infinite is never applied: the run stops,
    # naming the step, and its checkpoints keep the last finite state. N > 0 skips up to N such
    # steps in total over the run's life (resumes included) before it stops; a skipped step
    # consumes its batch and does not count towards trainer.max_steps (longctx.train.nonfinite)
    skip_nonfinite: int = 0

    def __post_init__(self) -> None:
        for name in ("optimizer", "scheduler"):
            factory = getattr(self, name)
            if not callable(factory) and not (name == "scheduler" and factory is None):
                raise LongctxError(
                    f"optim.{name}={factory!r}; expected a factory (a _target_ with _partial_: true)"
                )
        # a partial's lr: a negative one is refused now, not once the model is built
        if (lr := (getattr(self.optimizer, "keywords", None) or {}).get("lr")) is not None:
            require_finite("optimizer.lr", lr, least=0)
        require_finite("weight_decay", self.weight_decay, least=0)
        if self.grad_clip is not None:
            require_finite("grad_clip", self.grad_clip, least=0, note=" (0 or null: no clip)")
        require_int("accumulate_grad_batches", self.accumulate_grad_batches, least=1)
        NonFiniteGuard(self.skip_nonfinite)  # the owner of optim.skip_nonfinite's rule
        if not isinstance(self.allow_global_batch_change, bool):
            raise LongctxError(
                f"optim.allow_global_batch_change={self.allow_global_batch_change!r}; "
                "expected true or false"
            )

    @classmethod
    def from_settings(cls, settings: dict[str, Any], **factories: Any) -> OptimConfig:
        """From the group's settings (every key but the factories') and its instantiated
        ``optimizer`` / ``scheduler``; an unknown key is refused naming it."""
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in factories]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise LongctxError(
                f"optim.{unknown[0]}: unknown optim setting{'s' if len(unknown) > 1 else ''} "
                f"{unknown}; expected optimizer, scheduler or one of {fields}"
            )
        return cls(**settings, **factories)


def require_finite(name: str, value: Any, least: float, note: str = "") -> None:
    if not is_number(value) or not math.isfinite(value) or value < least:
        raise LongctxError(f"optim.{name}={value!r}; expected a finite number >= {least}{note}")


def require_int(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise LongctxError(f"optim.{name}={value!r}; expected a whole number >= {least}")
