"""Lightning callback: the effective-length suite at every N-th validation, into the logger and W&B.

The instances are generated once at setup from fixed arguments (their ``seed`` is the suite's,
not the run's: every arm and training seed of a sweep is scored on the same instances, so their
differences are paired). A length beyond model.max_seq_len, an unknown task, a depth outside
[0, 1], a length too short for a task and a missing haystack are refused there, before training.

Logged: ``val/ruler/<task>/<length>`` (accuracy), ``val/ruler/mean/<length>`` (the suite score)
and ``val/effective_length`` (0 when the model is below the threshold at every length; the rule
is longctx.eval.ruler.scoring's). Written (rank 0): ``<out>/ruler_results.csv`` (one row per
instance and step, appended: the input of the sweep report) and ``<out>/ruler_step<N>.json``;
with a W&B logger, the cell table (task x length x depth with 95% CIs) as ``val/ruler_table``.
``<out>`` defaults to the run folder's ``eval/``. Every rank scores (FSDP's collectives stay
matched); rank 0 writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L

from longctx.eval.files import append_rows, write_json
from longctx.eval.long_documents import check_eval_length, check_factor, multiples
from longctx.eval.ruler.generate import make_instances
from longctx.eval.ruler.scoring import score_instances, summarize

TABLE_KEY = "val/ruler_table"
TABLE_COLUMNS = ["step", "task", "length", "depth", "n", "accuracy", "ci_low", "ci_high"]


def default_lengths(seq_len: int, factor: int = 1) -> list[int]:
    """seq_len / 4, seq_len / 2, then 1x, 2x ... factor x seq_len."""
    return sorted({seq_len // 4, seq_len // 2} | {m * seq_len for m in multiples(factor)} - {0})


class RulerEval(L.Callback):
    def __init__(
        self,
        tasks: Sequence[str] | str | None = None,
        lengths: Sequence[int] | None = None,
        factor: int = 1,
        depths: Sequence[float] = (0.0, 0.5, 1.0),
        samples: int = 4,
        seed: int = 0,
        haystack: str = "books",
        batch_size: int = 4,
        every_n_validations: int = 1,
        out_dir: str | None = None,
    ) -> None:
        check_factor(factor)
        if every_n_validations < 1:
            raise ValueError(f"every_n_validations={every_n_validations}; expected >= 1")
        self.tasks, self.lengths, self.factor = tasks, lengths, factor
        self.depths, self.samples, self.seed = list(depths), samples, seed
        self.haystack, self.batch_size = haystack, batch_size
        self.every_n_validations, self.out_dir = every_n_validations, out_dir
        self.instances: list | None = None
        self._validations = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from longctx.data import load_tokenizer

        dm = trainer.datamodule
        lengths = list(self.lengths or default_lengths(dm.config.seq_len, self.factor))
        for n in lengths:
            check_eval_length(n, pl_module.model_config.max_seq_len, "RulerEval length")
        self.instances = make_instances(
            load_tokenizer(dm.manifest.tokenizer), self.tasks, lengths, self.depths,
            self.samples, self.seed, self.haystack, dm.config.cache_dir,
        )  # fmt: skip

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if self._validations % self.every_n_validations:
            return
        results = self.score(trainer, pl_module)
        report = summarize(results)
        for row in report["lengths"]:
            pl_module.log(f"val/ruler/{row['task']}/{row['length']}", row["accuracy"], batch_size=1)
        for row in report["suite"]:
            pl_module.log(f"val/ruler/mean/{row['length']}", row["accuracy"], batch_size=1)
        pl_module.log("val/effective_length", float(report["effective_length"] or 0), batch_size=1)
        if trainer.is_global_zero:
            self._write(trainer, results, report)

    def score(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[dict]:
        model = pl_module.model
        was_training = model.training
        model.eval()
        try:
            return score_instances(
                model, self.instances, self.batch_size, pl_module.device,
                trainer.precision_plugin.forward_context,
            )  # fmt: skip
        finally:
            model.train(was_training)

    def _write(self, trainer: L.Trainer, results: list[dict], report: dict) -> None:
        from longctx.eval.callbacks import wandb_runs

        step = trainer.global_step
        out = Path(self.out_dir or Path(trainer.default_root_dir) / "eval")
        append_rows(
            [{"step": step, "seed": self.seed, **r} for r in results], out / "ruler_results.csv"
        )
        write_json(
            {"step": step, "instance_seed": self.seed, **report}, out / f"ruler_step{step}.json"
        )
        runs = wandb_runs(trainer)
        if runs:
            import wandb

            data = [[step] + [c[k] for k in TABLE_COLUMNS[1:]] for c in report["cells"]]
            for run in runs:
                run.log(
                    {TABLE_KEY: wandb.Table(columns=TABLE_COLUMNS, data=data),
                     "trainer/global_step": step}
                )  # fmt: skip
