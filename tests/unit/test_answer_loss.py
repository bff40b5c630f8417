"""longctx.eval.answer_loss: held-out long-range documents scored on their answer tokens only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longctx.batch import IGNORE_INDEX
from longctx.data.tokenizer import load_tokenizer
from longctx.eval import answer_loss as A
from longctx.eval.documents import score_documents

TOKENIZER = load_tokenizer("byte")
TEXT = " ".join(f"Sentence {w} of the validation text." for w in ("one", "two", "three") * 40)


class LabelEcho(torch.nn.Module):
    """token_loss = 1 wherever a label is scored (so a document's loss sum is its token count),
    2 where the label is the digit '7': enough to check what is scored."""

    def token_loss(self, batch):
        scored = batch.labels != IGNORE_INDEX
        seven = batch.labels == TOKENIZER.encode("7")[0]
        return scored.float() * (1.0 + seven.float())


def test_documents_are_held_out_deterministic_and_fit_the_row():
    docs = A.answer_documents(TOKENIZER, TEXT, 8, 512, seed=0)
    again = A.answer_documents(TOKENIZER, TEXT, 8, 512, seed=0)
    other = A.answer_documents(TOKENIZER, TEXT, 8, 512, seed=1)
    assert [d[0] for d in docs] == ["ood_ledger", "ood_locker", "ood_relay", "ood_echo"] * 2
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(docs, again, strict=True))
    assert not all(np.array_equal(a[1], b[1]) for a, b in zip(docs, other, strict=True))
    assert all(len(t) == 512 and m.sum() > 0 for _, t, m in docs)


def test_only_answer_tokens_are_scored():
    docs = A.answer_documents(TOKENIZER, TEXT, 6, 300, seed=0)
    batches = A.answer_batches(docs, 300, 2, pad_id=0)
    rows = A.per_document(score_documents(LabelEcho(), batches, torch.device("cpu")), docs)
    for row, (name, tokens, mask) in zip(rows, docs, strict=True):
        assert row["task"] == name and row["tokens"] == int(mask[1:].sum())
        sevens = int(((tokens == TOKENIZER.encode("7")[0]) & mask)[1:].sum())
        assert row["loss_sum"] == pytest.approx(row["tokens"] + sevens)
    scored = [TOKENIZER.decode(t[m]) for _, t, m in docs]
    assert all("Entry" not in s and "Sentence" not in s for s in scored)  # values only


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="expected some of ood_ledger"):
        A.answer_documents(TOKENIZER, TEXT, 4, 512, tasks=["niah_single_1"])
    with pytest.raises(ValueError, match="more than the row"):
        A.answer_documents(TOKENIZER, TEXT, 4, 64, tasks=["ood_relay"])
    with pytest.raises(ValueError, match="documents=0"):
        A.HeldOutAnswerLoss(documents=0)
