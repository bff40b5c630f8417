"""Held-out loss that needs retrieval: the NLL of the answer tokens of held-out long-range documents.

The held-out loss on book chapters barely needs anything far back; here every scored token
needs it: fixed documents of the out-of-distribution tasks (:mod:`longctx.synthetic.ood`), drawn
from their own stream (``held_out_answers/<seed>/...``, never a training document's), each
scored alone on its answer tokens only. Every arm is scored on identical documents, so the
ablation report (:mod:`studies.ablation`) pairs them.

    callbacks: HeldOutAnswerLoss -> <run>/eval/held_out_answers.csv (step, doc, task, tokens,
    loss_sum) and val/answer_loss
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import lightning as L
import numpy as np
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.errors import LongctxError
from longctx.eval.documents import document_batches, score_documents
from longctx.eval.files import HELD_OUT_ANSWERS_CSV, append_rows, callback_out
from longctx.synthetic import Encoder, TextHaystack, ood
from longctx.synthetic.tasks import TASKS, check_tasks

STREAM = "held_out_answers"


def answer_documents(
    tokenizer, text: str, count: int, length: int, seed: int = 0, tasks: Sequence[str] | None = None
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``count`` (task, tokens, answer mask) documents of ``length`` tokens, the tasks in turn,
    their haystack the sentences of ``text``."""
    names = check_tasks(tasks or None, "answer_loss")  # the ood family
    if count < 1:
        raise LongctxError(f"answer documents: count {count}; expected a count >= 1")
    enc, haystack = Encoder(tokenizer), TextHaystack(text, "validation")
    docs = []
    for i in range(count):
        name = names[i % len(names)]
        rng = random.Random(f"{STREAM}/{seed}/{name}/{i}")
        units = haystack.units(enc, rng, " ")
        tokens, mask = ood.document(TASKS[name].build, rng, enc, length, units)
        if len(tokens) > length:
            raise LongctxError(
                f"{name} needs {len(tokens)} tokens, more than the row ({length}); score answer "
                "documents at a longer data.seq_len or leave this callback out"
            )
        docs.append((name, tokens, mask))
    return docs


def held_out_text(datamodule, tokenizer) -> str:
    """The text answer documents take their haystack from: the first folder's val split."""
    return "\n\n".join(tokenizer.decode(d[:-1]) for d in datamodule.val_documents(None))


def answer_batches(docs, seq_len: int, rows_per_batch: int, pad_id: int):
    """:func:`longctx.eval.documents.document_batches` of the documents, each its own segment,
    with every label but the answer tokens' set to ignore."""
    batches = document_batches([t for _, t, _ in docs], seq_len, rows_per_batch, pad_id)
    return [(_answers_only(batch, rows, docs), rows) for batch, rows in batches]


def _answers_only(batch: PackedBatch, rows: list[list[int]], docs) -> PackedBatch:
    keep = torch.zeros_like(batch.labels, dtype=torch.bool)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            mask = torch.from_numpy(docs[i][2])
            keep[r, start : start + len(mask) - 1] = mask[1:]  # position p predicts token p + 1
            start += len(mask)
    labels = torch.where(keep, batch.labels, torch.full_like(batch.labels, IGNORE_INDEX))
    return PackedBatch(batch.tokens, labels, batch.position_ids, batch.seq_lens)


def per_document(records: list[dict], docs) -> list[dict]:
    """Per document: its task, answer tokens and their loss sum (the buckets summed)."""
    out = {
        i: {"doc": i, "task": docs[i][0], "tokens": 0, "loss_sum": 0.0} for i in range(len(docs))
    }
    for r in records:
        out[r["doc"]]["tokens"] += r["tokens"]
        out[r["doc"]]["loss_sum"] += r["loss_sum"]
    return list(out.values())


class HeldOutAnswerLoss(L.Callback):
    """At every validation: the loss on the answer tokens of ``documents`` held-out long-range
    documents of ``data.seq_len`` tokens (see the module docstring). Every rank scores (FSDP's
    collectives stay matched); rank 0 writes."""

    def __init__(self, documents: int = 64, rows_per_batch: int = 2, seed: int = 0,
                 tasks: Sequence[str] | None = None, out_dir: str | None = None) -> None:  # fmt: skip
        if documents < 1 or rows_per_batch < 1:
            raise LongctxError(
                f"documents={documents}, rows_per_batch={rows_per_batch}; expected >= 1"
            )
        self.documents, self.rows_per_batch, self.seed = documents, rows_per_batch, seed
        self.tasks, self.out_dir = tasks, out_dir
        self._docs, self._batches = None, None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Build the documents before training: a row too short for them stops here."""
        dm = trainer.datamodule
        tokenizer = dm.tokenizer()
        text = held_out_text(dm, tokenizer)
        seq_len = dm.config.seq_len
        self._docs = answer_documents(tokenizer, text, self.documents, seq_len, self.seed,
                                      self.tasks)  # fmt: skip
        self._batches = answer_batches(self._docs, seq_len, self.rows_per_batch, dm.pad_id)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        records = score_documents(pl_module.model, self._batches, pl_module.device,
                                  trainer.precision_plugin.forward_context)  # fmt: skip
        rows = per_document(records, self._docs)
        tokens = sum(r["tokens"] for r in rows)
        pl_module.log("val/answer_loss", sum(r["loss_sum"] for r in rows) / tokens, batch_size=1)
        if trainer.is_global_zero:
            out = callback_out(trainer, self.out_dir)
            step = trainer.global_step
            append_rows([{"step": step, **r} for r in rows], out / HELD_OUT_ANSWERS_CSV)
