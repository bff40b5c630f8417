"""longctx.eval: per-position loss buckets, the passkey probe, the callback and the CLI."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import FAST, assert_close_scaled, run_train

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data import ByteTokenizer
from longctx.eval import cli
from longctx.eval.long_documents import probe_lengths
from longctx.eval.passkey import accuracy_table, make_probe, make_probes, score_probes
from longctx.eval.position_loss import PositionLoss, bucket_starts
from longctx.eval.ruler.scoring import answer_logits, instance_batch
from longctx.model import Llama, LlamaConfig

EOS = ByteTokenizer.EOS


# ------------------------------------------------------------------ per-position loss buckets
def hand_batch(document_mask: bool) -> PackedBatch:
    """One row of 8: documents [10 11 EOS] [12 13 14 EOS] [15 ...], losses 1..8 by position."""
    stream = torch.tensor([[10, 11, EOS, 12, 13, 14, EOS, 15, 16]])
    batch = PackedBatch.from_eos(stream, EOS, reset_position_ids=True)
    if not document_mask:  # the no-masking arm: one segment per row, same tokens and labels
        batch = PackedBatch(batch.tokens, batch.labels, batch.position_ids, torch.tensor([[8]]))
    return batch


@pytest.mark.parametrize("document_mask", [True, False])
def test_position_buckets_match_hand_computation(document_mask):
    batch = hand_batch(document_mask)
    assert batch.labels.tolist() == [[11, EOS, IGNORE_INDEX, 13, 14, EOS, IGNORE_INDEX, 16]]
    acc = PositionLoss(8, eos_id=EOS)
    acc.update(torch.arange(1.0, 9.0).view(1, 8), batch)
    # buckets [0], [1], [2, 4), [4, 8); positions 2 and 6 (EOS) carry no loss
    # absolute: {0: 1}, {1: 2}, {3: 4}, {4: 5, 5: 6, 7: 8}
    # in document (0 1 2 | 0 1 2 3 | 0): {0,3,7: 1,4,8}, {1,4: 2,5}, {5: 6}, {}
    means = acc.bucket_means()
    assert acc.starts == [0, 1, 2, 4]
    assert means["absolute"] == pytest.approx([1.0, 2.0, 4.0, 19 / 3])
    assert means["in_document"][:3] == pytest.approx([13 / 3, 3.5, 6.0])
    assert math.isnan(means["in_document"][3])
    assert acc.mean_loss() == pytest.approx((1 + 2 + 4 + 5 + 6 + 8) / 6)
    metrics = acc.bucket_metrics("val")
    assert metrics["val/loss_by_doc_pos/1"] == pytest.approx(3.5)
    assert "val/loss_by_doc_pos/4" not in metrics  # empty bucket skipped


def test_position_records_are_tidy():
    acc = PositionLoss(8, eos_id=EOS)
    acc.update(torch.arange(1.0, 9.0).view(1, 8), hand_batch(True))
    rows = acc.records()
    assert len(rows) == 8 and {r["kind"] for r in rows} == {"absolute", "in_document"}
    first = rows[3]
    assert first == {"kind": "absolute", "bucket_start": 4, "bucket_end": None,
                     "loss": pytest.approx(19 / 3), "tokens": 3}  # fmt: skip
    assert [r["tokens"] for r in rows[4:]] == [3, 2, 1, 0]


def test_bucket_starts_are_log_spaced():
    assert bucket_starts(1) == [0]
    assert bucket_starts(1024) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert bucket_starts(1025) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


# --------------------------------------------------------------------------- passkey probe
def text(tokens) -> str:
    return ByteTokenizer().decode(tokens)


def test_probe_generator_is_deterministic_and_exact():
    tok = ByteTokenizer()
    a = make_probes(tok, [128, 256], depths=[0.0, 0.5, 1.0], samples=2, seed=3)
    b = make_probes(tok, [128, 256], depths=[0.0, 0.5, 1.0], samples=2, seed=3)
    assert [p.answer for p in a] == [p.answer for p in b]
    assert all(np.array_equal(p.tokens, q.tokens) for p, q in zip(a, b, strict=True))
    other = make_probes(tok, [128, 256], depths=[0.0, 0.5, 1.0], samples=2, seed=4)
    assert [p.answer for p in a] != [p.answer for p in other]
    for p in a:
        # the prompt leaves the generation budget: prompt + tokens_to_generate = n
        assert len(p.prompt) == p.length - p.tokens_to_generate
        assert text(p.tokens).endswith(f"The pass key is {p.answer}")
        assert text(p.tokens).count(p.answer) == 2  # the needle and the answer


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_sits_at_its_depth(depth):
    probe = make_probe(ByteTokenizer(), 400, depth, seed=0)
    body = text(probe.tokens)
    needle = body.index(" The pass key is ")
    context = body[: body.index(" What is the pass key?")]
    assert needle == 0 or context[:needle].endswith(".")  # between the filler's sentences
    assert abs(needle / len(context) - depth) < 0.3  # within a sentence or two of 300 bytes


def test_probe_labels_only_on_the_answer():
    probe = make_probe(ByteTokenizer(), 128, 0.5, seed=1)
    labels = probe.labels()
    assert (labels != IGNORE_INDEX).sum() == probe.answer_len == 6  # " " + 5 digits
    answer = labels[labels != IGNORE_INDEX]
    assert text(answer) == f" {probe.answer}"
    batch = instance_batch([probe, make_probe(ByteTokenizer(), 128, 0.0, seed=1)])
    n = len(probe.tokens) - 1  # 128 - tokens_to_generate + the answer, less the last target
    assert batch.shape == (2, n) and batch.seq_lens.tolist() == [[n], [n]]
    # each label is the next input token: teacher forcing over the answer span
    mask = batch.labels[0] != IGNORE_INDEX
    positions = mask.nonzero().flatten()
    assert torch.equal(batch.tokens[0, positions[1:]], batch.labels[0, positions[:-1]])


def test_probe_errors_name_the_bad_value():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="length=40 is too short"):
        make_probe(tok, 40, 0.5, seed=0)
    with pytest.raises(ValueError, match="depth=1.5"):
        make_probe(tok, 256, 1.5, seed=0)
    with pytest.raises(ValueError, match="one token count"):
        instance_batch([make_probe(tok, 128, 0, 0), make_probe(tok, 256, 0, 0)])


def test_probe_lengths_from_1024_to_the_length():
    assert probe_lengths(8192, 1) == [1024, 2048, 4096, 8192]
    assert probe_lengths(3000, 1) == [1024, 2048, 3000]
    assert probe_lengths(256, 1) == [256]


class ForcedModel(torch.nn.Module):
    """Logits with all mass on the true next token, or on a wrong one at chosen answer tokens."""

    def __init__(self, vocab: int = 259, wrong_answer_tokens: tuple[int, ...] = ()):
        super().__init__()
        self.vocab, self.wrong = vocab, wrong_answer_tokens

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        b, n = batch.shape
        target = torch.where(batch.labels == IGNORE_INDEX, 0, batch.labels)
        answer_index = (batch.labels != IGNORE_INDEX).cumsum(dim=1) - 1
        for k in self.wrong:
            flip = (answer_index == k) & (batch.labels != IGNORE_INDEX)
            target = torch.where(flip, (target + 1) % self.vocab, target)
        logits = torch.full((b, n, self.vocab), -1e4)
        return logits.scatter(2, target[..., None], 1e4)


@pytest.mark.parametrize(
    "wrong, correct, token_accuracy",
    [((), True, 1.0), ((0, 1, 2, 3, 4, 5), False, 0.0), ((5,), False, 5 / 6)],
)
def test_scoring_with_a_forced_model(wrong, correct, token_accuracy):
    probes = make_probes(ByteTokenizer(), [128, 160], depths=[0.0, 1.0], samples=3, seed=0)
    results = score_probes(ForcedModel(wrong_answer_tokens=wrong), probes, batch_size=4)
    assert len(results) == len(probes) == 12
    assert [r["passkey"] for r in results] == [p.answer for p in probes]
    assert all(r["correct"] is correct for r in results)
    assert all(r["token_accuracy"] == pytest.approx(token_accuracy) for r in results)
    table = accuracy_table(results)
    assert [(r["length"], r["depth"], r["samples"]) for r in table] == [
        (128, 0.0, 3), (128, 1.0, 3), (160, 0.0, 3), (160, 1.0, 3),
    ]  # fmt: skip
    assert all(r["accuracy"] == float(correct) for r in table)


def test_accuracy_table_averages_per_cell():
    results = [
        {"length": 8, "depth": 0.5, "correct": c, "token_accuracy": a}
        for c, a in [(True, 1.0), (False, 0.5), (False, 0.0), (True, 1.0)]
    ]
    assert accuracy_table(results) == [
        {"length": 8, "depth": 0.5, "accuracy": 0.5, "token_accuracy": 0.625, "samples": 4}
    ]


def test_answer_logits_from_hidden_states_equal_forward():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                         ffn_dim=64, attn_backend="sdpa")  # fmt: skip
    model = Llama(config).eval()
    batch = instance_batch(make_probes(ByteTokenizer(), [96], depths=[0.0, 1.0], samples=1))
    mask = batch.labels != IGNORE_INDEX
    with torch.no_grad():
        full = model(batch)[mask]
        assert_close_scaled(answer_logits(model, batch), full)


# ----------------------------------------------------------------- callback and CLI (trained)
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 2-step tiny run with callbacks=eval (validation after steps 1 and 2, probe at fit end)."""
    tmp = tmp_path_factory.mktemp("evalrun")
    probe = ["+callbacks.position_curves.probe_lengths=[128]"]
    run_train([*FAST, "run_name=r", "callbacks=eval", "trainer.max_steps=2",
               "trainer.val_check_interval=1", *probe], tmp)  # fmt: skip
    return tmp / "outputs" / "train" / "r"


@pytest.mark.slow
def test_callback_writes_curves_and_probe(trained_run):
    curves = pd.read_csv(trained_run / "eval" / "position_loss.csv")
    assert sorted(curves["step"].unique()) == [1, 2]
    assert set(curves["kind"]) == {"absolute", "in_document"}
    assert list(curves[curves.step == 2]["bucket_start"].unique()) == bucket_starts(256)
    snapshot = json.loads((trained_run / "eval" / "position_loss_step2.json").read_text())
    logged = pd.read_csv(trained_run / "csv" / "metrics.csv").dropna(subset=["val/loss"])
    assert snapshot["val_loss"] == pytest.approx(logged["val/loss"].iloc[-1], rel=1e-5)
    for r in snapshot["buckets"]:
        if r["kind"] == "absolute" and r["tokens"]:
            column = f"val/loss_by_abs_pos/{r['bucket_start']}"
            assert r["loss"] == pytest.approx(logged[column].iloc[-1], rel=1e-5)
    probe = pd.read_csv(trained_run / "eval" / "passkey_accuracy.csv")
    assert list(probe["length"].unique()) == [128] and probe["samples"].eq(2).all()
    assert probe["accuracy"].between(0, 1).all()
    # the long held-out documents, out to 4 x 256 at every validation
    long = pd.read_csv(trained_run / "eval" / "long_documents.csv")
    assert sorted(long["step"].unique()) == [1, 2] and long["bucket_start"].max() == 512
    octaves = json.loads((trained_run / "eval" / "long_documents_step2.json").read_text())
    assert [r["multiple"] for r in octaves["octaves"]] == [1, 2, 4]
    logged_long = pd.read_csv(trained_run / "csv" / "metrics.csv").dropna(
        subset=["val/long_loss/4x"]
    )
    for r in octaves["octaves"]:
        assert r["loss"] == pytest.approx(logged_long[f"val/long_loss/{r['multiple']}x"].iloc[-1])


@pytest.mark.slow
def test_cli_reproduces_the_logged_validation(trained_run, tmp_path):
    # outside its run folder: the model and data config come from the checkpoint itself
    ckpt = tmp_path / "moved.ckpt"
    shutil.copy(trained_run / "checkpoints" / "last.ckpt", ckpt)
    out = tmp_path / "eval"
    summary = cli.main([str(ckpt), "--out", str(out), "--probe-lengths", "128",
                        "--probe-depths", "0", "1", "--probe-samples", "1"])  # fmt: skip
    logged = pd.read_csv(trained_run / "csv" / "metrics.csv").dropna(subset=["val/loss"])
    # the same weights on the same fixed validation set give the logged validation loss
    assert summary["val_loss"] == pytest.approx(logged["val/loss"].iloc[-1], rel=1e-4)
    assert json.loads((out / "eval.json").read_text())["seq_len"] == 256
    table = pd.read_csv(out / "passkey_accuracy.csv")
    assert table[["length", "depth"]].values.tolist() == [[128, 0.0], [128, 1.0]]
    assert len(pd.read_csv(out / "position_loss.csv")) == 2 * len(bucket_starts(256))
    assert [r["end"] for r in summary["long_documents"]] == [256, 512, 1024]
    with pytest.raises(ValueError, match=r"evaluation length 262144 \(--long-factor 1024 x "
                       r"seq_len\) exceeds model.max_seq_len=131072"):  # fmt: skip
        cli.main([str(ckpt), "--out", str(out), "--long-factor", "1024"])


class _RunsCode:
    """Unpickling this runs code: what a crafted checkpoint does."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def test_cli_refuses_a_checkpoint_that_would_run_code(tmp_path):
    crafted = tmp_path / "run" / "checkpoints" / "last.ckpt"
    crafted.parent.mkdir(parents=True)
    marker = tmp_path / "code_ran"
    torch.save({"state_dict": {"model.x": torch.zeros(1)}, "x": _RunsCode(marker)}, crafted)
    with pytest.raises(ValueError, match=r"last\.ckpt cannot be read as a weights-only"):
        cli.main([str(crafted), "--no-probe"])
    assert not marker.exists()


def test_cli_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt does not exist"):
        cli.main([str(tmp_path / "missing.ckpt"), "--no-probe"])
    (tmp_path / "empty.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.ckpt is empty \(0 bytes\)"):
        cli.main([str(tmp_path / "empty.ckpt"), "--no-probe"])
    torch.save({"state_dict": {"model.x": torch.zeros(1)}}, tmp_path / "bare.ckpt")
    with pytest.raises(ValueError, match=r"bare\.ckpt holds no run config"):
        cli.main([str(tmp_path / "bare.ckpt"), "--no-probe"])
    torch.save({"state_dict": {"other.weight": torch.zeros(1)}}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match="no 'model"):
        cli.model_state_dict(torch.load(tmp_path / "x.ckpt"), tmp_path / "x.ckpt")
