"""Lightning callback: the effective-length suite at every N-th validation, into the logger and W&B.

The instances are generated once at setup from fixed arguments (their ``seed`` is the suite's,
not the run's: every arm and training seed of a sweep is scored on the same instances, so their
differences are paired); bad settings are refused there, before training. Every rank runs the
same number of forward passes (a replica's share is padded with its own instances), so FSDP's
collectives stay matched. Scoring modes, what is logged and written: docs/effective-length.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from longctx.context_shard import data_parallel_rank_and_size
from longctx.cp_balance import rank_unit
from longctx.eval.documents import eval_mode
from longctx.eval.files import RULER_RESULTS_CSV, append_rows, callback_out, log_wandb, write_json
from longctx.eval.long_documents import check_eval_length, check_factor, multiples
from longctx.eval.ruler.generate import plan_instances
from longctx.eval.ruler.scoring import TEACHER_FORCED, check_mode, score_instances, summarize
from longctx.model.validation import require_positive_int

TABLE_KEY = "val/ruler_table"
TABLE_COLUMNS = ["step", "task", "length", "depth", "n", "score", "ci_low", "ci_high"]


def default_ruler_lengths(seq_len: int, factor: int = 1) -> list[int]:
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
        scoring: str = TEACHER_FORCED,
        qa_data: str | None = None,
    ) -> None:
        """qa_data: a folder with RULER's squad.json / hotpotqa.json (qa_1, qa_2); without it
        they are skipped and said, as a length too short for a task is."""
        check_factor(factor)
        self.scoring = check_mode(scoring)
        # counts: checked here, before training (a bad one once failed at the first validation)
        for name, count in (("batch_size", batch_size), ("samples", samples),
                            ("every_n_validations", every_n_validations)):  # fmt: skip
            require_positive_int(name, count)
        self.tasks, self.lengths, self.factor = tasks, lengths, factor
        self.depths, self.samples, self.seed = list(depths), samples, seed
        self.haystack, self.batch_size = haystack, batch_size
        self.every_n_validations, self.out_dir = every_n_validations, out_dir
        self.qa_data = qa_data
        self.instances: list | None = None
        self.tokenizer = None
        self.anchor: int | None = None  # the training length, when evaluated
        self._validations = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        lengths = list(self.lengths or default_ruler_lengths(dm.config.seq_len, self.factor))
        for n in lengths:
            check_eval_length(n, pl_module.model_config.max_seq_len, "RulerEval length")
        self.tokenizer = dm.tokenizer()
        self.anchor = dm.config.seq_len if dm.config.seq_len in lengths else None
        plan = plan_instances(
            self.tokenizer, self.tasks, lengths, self.depths, self.samples, self.seed,
            self.haystack, dm.config.cache_dir, qa_data=self.qa_data,
        )  # fmt: skip
        rank_zero_info(f"RulerEval: {plan.describe()}")
        self.instances = plan.instances

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validations += 1
        if self._validations % self.every_n_validations:
            return
        results = self.score(trainer, pl_module)
        report = summarize(results, self.anchor)
        for row in report["lengths"]:
            pl_module.log(f"val/ruler/{row['task']}/{row['length']}", row["score"], batch_size=1)
        for row in report["suite"]:
            pl_module.log(f"val/ruler/mean/{row['length']}", row["score"], batch_size=1)
        for rule, key in (
            ("ruler", "val/effective_length"),
            ("relative", "val/effective_length_relative"),
        ):
            if report["effective_length"][rule] is not None:
                length = report["effective_length"][rule]["length"]
                pl_module.log(key, float(length or 0), batch_size=1)
        if trainer.is_global_zero:
            self._write(trainer, results, report)

    def score(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[dict]:
        """Every instance's row, in order, on every rank: each data-parallel replica scores
        its share under the run's context parallelism; the rows are gathered."""
        cp = getattr(pl_module, "context_parallel", 1)
        dp_rank, dp_size = data_parallel_rank_and_size(trainer.global_rank, trainer.world_size, cp)
        mine = replica_share(self.instances, dp_rank, dp_size)
        with eval_mode(pl_module.model) as model:
            rows = score_instances(
                model, [self.instances[i] for i in mine], self.batch_size, pl_module.device,
                trainer.precision_plugin.forward_context, scoring=self.scoring,
                tokenizer=self.tokenizer, shard=pl_module.rank_shard if cp > 1 else None,
                row_multiple=split_unit(pl_module),
            )  # fmt: skip
        return gather_rows(list(zip(mine, rows, strict=True)), len(self.instances), trainer)

    def _write(self, trainer: L.Trainer, results: list[dict], report: dict) -> None:
        step = trainer.global_step
        out = callback_out(trainer, self.out_dir)
        append_rows(
            [{"step": step, "seed": self.seed, **r} for r in results], out / RULER_RESULTS_CSV
        )
        write_json(
            {"step": step, "instance_seed": self.seed, **report}, out / f"ruler_step{step}.json"
        )
        data = [[step] + [c[k] for k in TABLE_COLUMNS[1:]] for c in report["cells"]]
        log_wandb(
            trainer,
            lambda wandb: {
                TABLE_KEY: wandb.Table(columns=TABLE_COLUMNS, data=data),
                "trainer/global_step": step,
            },
        )


def replica_share(instances: Sequence, rank: int, size: int) -> list[int]:
    """Indices of data-parallel replica ``rank``'s instances: each batch shape's instances dealt
    round-robin, every share padded to the largest one with repeats of its own (a replica that
    has none of a shape gets a repeat of another replica's), so every replica runs the same
    batches of the same shapes."""
    shapes: dict[tuple, list[int]] = {}
    for i, p in enumerate(instances):
        shapes.setdefault((len(p.tokens), len(p.prompt), p.tokens_to_generate), []).append(i)
    mine: list[int] = []
    for group in shapes.values():
        share = group[rank::size]
        largest = -(-len(group) // size)
        mine += share + (share or group)[:1] * (largest - len(share))
    return mine


def gather_rows(indexed: list[tuple[int, dict]], total: int, trainer: L.Trainer) -> list[dict]:
    """The (index, row) pairs of every rank, one row per index (the copies of padding and of
    the context-parallel ranks dropped), in index order."""
    gathered = [indexed]
    if trainer.world_size > 1:
        gathered = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, indexed)
    rows: dict[int, dict] = {}
    for part in gathered:
        rows.update(part)
    if len(rows) != total:
        raise RuntimeError(f"the ranks scored {len(rows)} of the {total} instances")
    return [rows[i] for i in range(total)]


def split_unit(pl_module: L.LightningModule) -> int:
    """What a row must be a multiple of to be split over the run's context-parallel ranks."""
    cp = getattr(pl_module, "context_parallel", 1)
    if cp == 1:
        return 1
    return rank_unit(cp, pl_module.context_parallel_balance, pl_module.context_parallel_rounds)
