"""The step axis is the optimizer step: of every logged row, of validation, across resumes.

LongCtxModule accumulates micro-batches itself (manual optimisation), so Lightning counts
training batches where longctx counts optimizer steps. Left to Lightning, the loggers get a row
per micro-batch (its metrics repeated until the next step, at a step number that counts
micro-batches), ``val_check_interval`` counts micro-batches, and after an elastic resume that
changes the accumulation the batch count no longer maps onto steps at all. Here:

- a step's training metrics go to the loggers once, at ``trainer.global_step`` (optimizer steps
  done, the number checkpoints and evaluation files carry), every ``log_every_n_steps`` steps;
- validation metrics carry the same step (Lightning takes a logged ``step`` as the x-axis);
- ``trainer.val_check_interval`` (an int) counts optimizer steps: validation runs after the last
  micro-batch of every N-th step.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L

# the metric name Lightning's logger connector takes as the row's step (and drops from the row)
STEP_KEY = "step"


def log_at_step(trainer: L.Trainer, metrics: dict[str, float], step: int) -> None:
    """One row of ``metrics`` at optimizer step ``step`` in every logger (rank 0 writes)."""
    every = trainer.log_every_n_steps
    if not trainer.loggers or not every or step % every:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
        # written now, as Lightning's own logging does: a crash (kill -9, OOM) between
        # checkpoints must not lose the rows of the steps it did train
        logger.save()


def validate_at_optimizer_steps(trainer: L.Trainer, at_step_boundary: Callable[[], bool]) -> None:
    """Make an int ``trainer.val_check_interval`` count optimizer steps: validation runs at a
    step boundary whose ``global_step`` is a multiple of it, once per step. A float (a fraction
    of an epoch) and a stop request (Lightning validates before it stops) stay Lightning's."""
    interval = trainer.val_check_interval
    if not isinstance(interval, int):
        return
    loop = trainer.fit_loop.epoch_loop
    lightnings_check = loop._should_check_val_fx
    validated = {"step": None}

    def should_check_val(data_fetcher) -> bool:
        if not at_step_boundary() or not loop._should_check_val_epoch():
            return False
        if trainer.should_stop:
            return lightnings_check(data_fetcher)
        step = trainer.global_step
        due = step > 0 and step % interval == 0 and validated["step"] != step
        if due:
            validated["step"] = step
        return due

    loop._should_check_val_fx = should_check_val
