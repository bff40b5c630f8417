"""studies.ood_control: a run scored in its own out-of-distribution formats, every answer
teacher-forced and generated, the two paths agreeing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from export_helpers import make_run

from longctx.batch import IGNORE_INDEX
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import LongctxError
from longctx.eval.answer_loss import answer_batches, answer_documents, per_document
from longctx.eval.documents import score_documents
from longctx.model import Llama
from longctx.model.settings import LlamaSettings
from studies import ood_control as O

TOKENIZER = load_tokenizer("byte")
TEXT = " ".join(f"Sentence {w} of the validation text." for w in ("one", "two", "three") * 40)


def docs(count: int = 4, length: int = 300):
    return answer_documents(TOKENIZER, TEXT, count, length, seed=0)


def tiny_model() -> Llama:
    torch.manual_seed(0)
    settings = LlamaSettings(vocab_size=TOKENIZER.vocab_size, dim=32, n_layers=1, n_heads=2,
                             n_kv_heads=2, ffn_dim=64, max_seq_len=512, attn_backend="sdpa")  # fmt: skip
    return Llama(settings).eval()


class Oracle(torch.nn.Module):
    """Logits that are one-hot on every label: every answer exact (teacher-forced)."""

    output_weight = torch.zeros(1)

    def labelled_logits(self, batch):
        labels = batch.labels[batch.labels != IGNORE_INDEX]
        return torch.nn.functional.one_hot(labels, TOKENIZER.vocab_size).float() * 30


def test_answer_spans_are_the_runs_of_answer_tokens():
    mask = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1, 1], bool)
    assert O.answer_spans(mask) == [(1, 3), (5, 6), (7, 10)]
    assert O.answer_spans(np.zeros(4, bool)) == []


def test_random_model_agrees_on_both_paths_and_its_loss_is_the_answer_loss():
    model, documents = tiny_model(), docs()
    rows = [O.score_document(model, t, m) for _, t, m in documents]
    assert all(rows) and all(r["exact"] == r["generated_exact"] for d in rows for r in d)
    # the same loss as the in-loop held-out answer loss on the same documents
    batches = answer_batches(documents, 300, 1, pad_id=0)
    expected = per_document(score_documents(model, batches, "cpu"), documents)
    for d, want in zip(rows, expected, strict=True):
        assert sum(r["tokens"] for r in d) == want["tokens"]
        assert sum(r["loss_sum"] for r in d) == pytest.approx(want["loss_sum"], rel=1e-5)


def test_an_answer_right_on_both_paths_is_exact(monkeypatch):
    (_, tokens, mask), = docs(1)  # fmt: skip
    monkeypatch.setattr(O, "greedy_generate", lambda m, prompt, max_new_tokens:
                        tokens[len(prompt) : len(prompt) + max_new_tokens].tolist())  # fmt: skip
    rows = O.score_document(Oracle(), tokens, mask)
    assert rows and all(r["exact"] == r["generated_exact"] == 1 for r in rows)
    assert all(r["right_tokens"] == r["tokens"] and r["other_value"] == 0 for r in rows)
    assert O.summary([{"task": "ood_ledger", **r} for r in rows])["all"]["exact"] == 1.0


def test_paths_that_disagree_are_refused(monkeypatch):
    (_, tokens, mask), = docs(1)  # fmt: skip
    monkeypatch.setattr(
        O, "greedy_generate", lambda m, prompt, max_new_tokens: [0] * max_new_tokens
    )
    with pytest.raises(RuntimeError, match="must agree"):
        O.score_document(Oracle(), tokens, mask)


def test_cli_scores_a_run_and_refuses_bad_counts(tmp_path):
    run = make_run(tmp_path, seq_len=512)
    O.main([str(run), "--out", str(tmp_path / "scores"), "--documents", "4", "--length", "300"])
    result = json.loads((tmp_path / "scores" / "run.json").read_text())
    assert result["length"] == 300 and result["summary"]["all"]["answers"] >= 4
    assert set(result["summary"]) == {*O.TASKS, "all"}
    with pytest.raises(LongctxError, match="--documents 0"):
        O.main([str(run), "--out", str(tmp_path / "x"), "--documents", "0"])
