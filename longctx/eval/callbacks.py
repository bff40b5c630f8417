"""Lightning callback: the per-position loss curve (and the passkey probe) into the run folder and W&B.

The module's validation already logs every bucket as a scalar (``val/loss_by_abs_pos/<start>``);
this callback adds what scalars cannot show: the whole curve at each validation (CSV, JSON and a
W&B table) and, at the end of fit, the passkey probe. ``<out>`` defaults to the run folder's
``eval/``; the files are longctx.eval.files'.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch

from longctx.errors import LongctxError
from longctx.eval.documents import document_batches, eval_mode, mean_loss, score_documents
from longctx.eval.files import (
    HELD_OUT_DOCUMENTS_CSV,
    LONG_DOCUMENTS_CSV,
    PASSKEY_ACCURACY_CSV,
    PASSKEY_PROBES_CSV,
    POSITION_LOSS_CSV,
    append_rows,
    callback_out,
    log_wandb,
    write_json,
    write_rows,
)
from longctx.eval.long_documents import (
    check_eval_length,
    check_factor,
    load_long_documents,
    octave_metrics,
    octave_table,
    probe_lengths,
    score_long_documents,
)
from longctx.eval.passkey import accuracy_table, make_probes, score_probes
from longctx.eval.ruler.generate import DEFAULT_DEPTHS


class PositionLossCurves(L.Callback):
    def __init__(
        self,
        out_dir: str | None = None,
        probe: bool = True,
        probe_lengths: Sequence[int] | None = None,
        probe_depths: Sequence[float] = DEFAULT_DEPTHS,
        probe_samples: int = 2,
        probe_batch_size: int = 4,
        seed: int = 0,
        probe_factor: int = 1,
    ) -> None:
        check_factor(probe_factor)
        self.out_dir = out_dir
        self.probe, self.probe_lengths, self.probe_factor = probe, probe_lengths, probe_factor
        self.probe_depths, self.probe_samples = list(probe_depths), probe_samples
        self.probe_batch_size, self.seed = probe_batch_size, seed

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Refuse probe lengths RoPE is not configured for before training, not at its end."""
        if self.probe and trainer.datamodule is not None:
            for n in self._probe_lengths(trainer.datamodule.config.seq_len):
                check_eval_length(n, pl_module.model_config.max_seq_len, "passkey probe length")

    def _probe_lengths(self, seq_len: int) -> list[int]:
        return list(self.probe_lengths or probe_lengths(seq_len, self.probe_factor))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        acc = getattr(pl_module, "val_position_loss", None)
        if trainer.sanity_checking or not trainer.is_global_zero or acc is None:
            return
        step = trainer.global_step
        rows = [{"step": step, **r} for r in acc.records()]
        out = callback_out(trainer, self.out_dir)
        append_rows(rows, out / POSITION_LOSS_CSV)
        write_json(
            {"step": step, "val_loss": acc.mean_loss(), "buckets": rows},
            out / f"position_loss_step{step}.json",
        )
        log_wandb(trainer, lambda wandb: curve_plots(wandb, rows, step))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.probe or not trainer.is_global_zero or trainer.datamodule is None:
            return
        results = self.run_probe(trainer, pl_module)
        table = accuracy_table(results)
        out = callback_out(trainer, self.out_dir)
        write_rows(results, out / PASSKEY_PROBES_CSV)
        write_rows(table, out / PASSKEY_ACCURACY_CSV)
        write_json({"step": trainer.global_step, "passkey": table}, out / "passkey.json")
        columns = list(table[0])
        data = [[r[c] for c in columns] for r in table]
        log_wandb(
            trainer,
            lambda wandb: {"eval/passkey_accuracy": wandb.Table(columns=columns, data=data)},
        )

    def run_probe(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[dict]:
        dm = trainer.datamodule
        tokenizer = dm.tokenizer()
        lengths = self._probe_lengths(dm.config.seq_len)
        probes = make_probes(tokenizer, lengths, self.probe_depths, self.probe_samples, self.seed)
        with eval_mode(pl_module.model) as model, torch.no_grad():
            return score_probes(model, probes, self.probe_batch_size, pl_module.device)


def curve_plots(wandb, rows: list[dict], step: int) -> dict:
    """W&B line plots of one validation's curve, one per kind of position."""
    columns = ["step", "kind", "bucket_start", "loss", "tokens"]
    payload = {"trainer/global_step": step}
    for kind in ("absolute", "in_document"):
        data = [[r[c] for c in columns] for r in rows if r["kind"] == kind and r["tokens"]]
        table = wandb.Table(columns=columns, data=data)
        payload[f"val/position_loss_{kind}"] = wandb.plot.line(
            table, "bucket_start", "loss", title=f"val loss by {kind} position (log2 buckets)"
        )
    return payload


class HeldOutDocumentLoss(L.Callback):
    """At every validation: the loss on fixed held-out documents, each attended alone.

    Every arm of an ablation is scored on identical inputs (:mod:`longctx.eval.documents`);
    rows per (step, document, position bucket) are appended to ``<out>/held_out_documents.csv``
    for the paired bootstrap of ``python -m studies.analysis``, ``val/held_out_loss`` is logged,
    and W&B gets the per-bucket curve as a table. Every rank scores the same documents (so FSDP's
    collectives stay matched); rank 0 writes.
    """

    def __init__(
        self, num_documents: int | None = None, rows_per_batch: int = 2, out_dir: str | None = None
    ) -> None:
        """``num_documents``: the first N of the val split; None scores all of it."""
        if (num_documents is not None and num_documents < 1) or rows_per_batch < 1:
            raise LongctxError(
                f"num_documents={num_documents}, rows_per_batch={rows_per_batch}; expected >= 1"
            )
        self.num_documents, self.rows_per_batch = num_documents, rows_per_batch
        self.out_dir = out_dir
        self._batches = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._document_batches(trainer.datamodule)  # a bad num_documents stops before training

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        records = score_documents(
            pl_module.model,
            self._document_batches(trainer.datamodule),
            pl_module.device,
            trainer.precision_plugin.forward_context,
        )
        pl_module.log("val/held_out_loss", mean_loss(records), batch_size=1)
        if trainer.is_global_zero:
            step = trainer.global_step
            out = callback_out(trainer, self.out_dir)
            append_rows([{"step": step, **r} for r in records], out / HELD_OUT_DOCUMENTS_CSV)
            curve = position_curve(records)
            columns = ["bucket_start", "loss", "tokens"]
            log_wandb(
                trainer,
                lambda wandb: {
                    "val/held_out_position_loss": wandb.Table(columns=columns, data=curve),
                    "trainer/global_step": step,
                },
            )

    def _document_batches(self, datamodule):
        if self._batches is None:
            docs = datamodule.val_documents(self.num_documents)
            seq_len = datamodule.config.seq_len
            self._batches = document_batches(docs, seq_len, self.rows_per_batch, datamodule.pad_id)
        return self._batches


def position_curve(records: list[dict]) -> list[list]:
    """[bucket_start, token-weighted loss, tokens] per in-document bucket, sorted."""
    sums: dict[int, list[float]] = {}
    for r in records:
        acc = sums.setdefault(r["bucket_start"], [0.0, 0])
        acc[0] += r["loss_sum"]
        acc[1] += r["tokens"]
    return [[start, total / count, count] for start, (total, count) in sorted(sums.items())]


class LongDocumentLoss(L.Callback):
    """At every validation: per-position loss on the long held-out documents out to ``factor``
    x the training length (:mod:`longctx.eval.long_documents`).

    Logs ``val/long_loss/<m>x`` for the octave ending at m x seq_len, appends the per (step,
    document, log2 bucket) records to ``<out>/long_documents.csv`` and writes the octave table
    to ``<out>/long_documents_step<N>.json``. Every rank scores (FSDP's collectives stay
    matched); rank 0 writes. A length beyond model.max_seq_len is refused at setup.
    """

    def __init__(self, factor: int = 4, out_dir: str | None = None) -> None:
        check_factor(factor)
        self.factor, self.out_dir = factor, out_dir
        self._docs = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        seq_len = trainer.datamodule.config.seq_len
        check_eval_length(
            self.factor * seq_len,
            pl_module.model_config.max_seq_len,
            f"LongDocumentLoss factor={self.factor} x data.seq_len={seq_len}",
        )
        self._docs = load_long_documents(trainer.datamodule.config)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        seq_len = trainer.datamodule.config.seq_len
        scored = score_long_documents(
            pl_module.model,
            self._docs,
            seq_len,
            self.factor,
            pl_module.model_config.max_seq_len,
            trainer.datamodule.pad_id,
            pl_module.device,
            trainer.precision_plugin.forward_context,
        )
        table = octave_table(scored["octaves"], seq_len, self.factor)
        for name, value in octave_metrics(table).items():
            pl_module.log(name, value, batch_size=1)
        if trainer.is_global_zero:
            step = trainer.global_step
            out = callback_out(trainer, self.out_dir)
            append_rows([{"step": step, **r} for r in scored["curve"]], out / LONG_DOCUMENTS_CSV)
            write_json({"step": step, "octaves": table}, out / f"long_documents_step{step}.json")
