"""The leak probe inside a run: ``callbacks=probe`` probes the run's own model, precision,
context-parallel split and rows when training starts, and stops the run if documents leak.

``python -m longctx.probe`` runs the same callback in a Trainer built as train.py builds it,
with ``stop_after=True``: the run ends after the probe, before its first step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L

from longctx.model.attention import resolve_backend
from longctx.probe import inject
from longctx.probe.checks import Target, check_checks, check_tolerances, packed_lm_forward, probe
from longctx.probe.data import run_rows
from longctx.probe.report import Report

JSON_NAME = "probe.json"


class LeakDetected(RuntimeError):
    """The probe found documents that do not stay apart; the run must not train on them."""


class LeakProbe(L.Callback):
    """checks: names from longctx.probe.checks.CHECKS (None: all); tolerances: relative
    overrides by check; batches: micro-batches per stage; out: the JSON path (None:
    <the run's folder>/probe.json); stop_after: end the run after the probe (the CLI)."""

    def __init__(
        self,
        checks: list[str] | None = None,
        tolerances: dict[str, float] | None = None,
        batches: int = 1,
        out: str | None = None,
        stop_after: bool = False,
        seed: int = 0,
    ) -> None:
        self.checks = check_checks(checks)
        self.tolerances = check_tolerances(tolerances)
        self.batches, self.out, self.stop_after, self.seed = batches, out, stop_after, seed
        self.report: Report | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.report = probe_module(
            trainer, pl_module, self.checks, self.tolerances, self.batches, self.seed
        )
        if trainer.is_global_zero:
            path = self.report.write_json(self.out or Path(trainer.default_root_dir) / JSON_NAME)
            print(f"{self.report.table()}\nwrote {path}", flush=True)
            stream = sys.stdout if self.report.passed else sys.stderr
            print(self.report.summary(), file=stream, flush=True)
        if self.stop_after:
            trainer.should_stop = True
        elif not self.report.passed:
            raise LeakDetected(f"{self.report.summary()}; the run stops before its first step")


def probe_module(
    trainer: L.Trainer, pl_module, checks, tolerances, batches: int, seed: int
) -> Report:
    """Probe a LongCtxModule as its trainer runs it: its model, the trainer's precision
    context, its context-parallel shard of each batch, and the datamodule's rows."""
    datamodule = trainer.datamodule
    device = pl_module.device
    bug = inject.injected()
    rows = [r.to(device) for r in inject.rows_with_bug(run_rows(datamodule, batches), bug)]
    target = Target(
        forward=packed_lm_forward(pl_module.model),
        vocab_size=datamodule.vocab_size,
        reset_position_ids=datamodule.config.reset_position_ids,
        shard=inject.shard_with_bug(pl_module.rank_shard, bug),
        context=trainer.precision_plugin.train_step_context,
    )
    report = probe(target, rows, checks, tolerances, seed)
    report.context = layout(trainer, pl_module, datamodule) | ({"injected_bug": bug} if bug else {})
    return report


def layout(trainer: L.Trainer, pl_module, datamodule) -> dict:
    """What was probed, for the JSON."""
    spec = pl_module.model_config
    backend = getattr(spec, "attn_backend", None)
    return {
        "model": type(pl_module.model).__name__,
        "attn_backend": backend and resolve_backend(backend, pl_module.device),
        "device": str(pl_module.device),
        "precision": str(trainer.precision),
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "context_parallel": pl_module.context_parallel,
        "context_parallel_rounds": pl_module.context_parallel_rounds,
        "reset_position_ids": datamodule.config.reset_position_ids,
        "training_mode": pl_module.training,
        **{m: sys.modules[m].__version__ for m in ("torch", "transformers") if m in sys.modules},
    }
