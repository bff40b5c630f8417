"""studies.ablation: arm losses and paired differences with bootstrap CIs, on synthetic runs with a
known answer; the analysis CLI's summary; the held-out W&B table written offline and read back."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers import write_run_record

from studies import ablation as S
from studies import analysis as A

DOCS, TOKENS = 64, 400


def doc_losses(seed: int) -> np.ndarray:
    """Per-document mean losses of a 'model': documents differ a lot (sd 0.5 nats)."""
    return 2.0 + 0.5 * np.random.default_rng(seed).standard_normal(DOCS)


def write_arm(root, reset, mask, losses, seed=0, group="position_ablation", seq_len=4096,
              packer="best_fit", steps=(10, 20)):  # fmt: skip
    """A run folder as train.py leaves it, with eval/held_out_documents.csv (two validations)."""
    run = root / f"reset={reset},mask={mask},packer={packer},seed={seed}"
    data = dict(reset_position_ids=reset, document_mask=mask, packer=packer, seq_len=seq_len)
    write_run_record(run, data, group=group, seed=seed)
    rows = []
    for step in steps:  # only the last validation counts; the first is deliberately off
        offset = 0.0 if step == max(steps) else 5.0
        for doc, loss in enumerate(losses):
            for bucket, share in ((0, 1), (1, 1), (2, 2), (4, TOKENS - 4)):
                rows.append({"step": step, "doc": doc, "bucket_start": bucket, "tokens": share,
                             "loss_sum": (loss + offset) * share})  # fmt: skip
    (run / "eval").mkdir()
    pd.DataFrame(rows).to_csv(run / "eval" / "held_out_documents.csv", index=False)
    return run


def noisy(losses: np.ndarray, seed: int, scale: float = 0.02) -> np.ndarray:
    return losses + scale * np.random.default_rng(seed).standard_normal(len(losses))


def arms_by_name(summary: dict) -> dict:
    return {row["arm"]: row for row in summary["arms"]}


def test_identical_arms_are_within_noise_and_a_shift_is_detected(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, True, True, noisy(base, 1))
    write_arm(tmp_path, False, True, noisy(base, 2))  # same model up to noise: the control pair
    write_arm(tmp_path, False, False, noisy(base, 3) + 0.1)  # 0.1 nats worse on every document
    summary = S.summarize(tmp_path, n_boot=2000)
    pairs = {(p["a"], p["b"]): p for p in summary["pairs"]}
    same = pairs["masked, continuous pos", "masked, reset pos"]
    assert same["ci"][0] < 0 < same["ci"][1] and same["verdict"] == "control"
    assert summary["training_noise"]["floor"] == max(map(abs, same["ci"]))
    shifted = pairs["unmasked, continuous pos", "masked, reset pos"]
    assert shifted["verdict"] == "differs" and 0.09 < shifted["delta"] < 0.11
    assert shifted["ci"][0] > 0.05 and shifted["ci"][1] < 0.15
    arms = arms_by_name(summary)
    assert summary["control"] == "masked, reset pos"
    assert arms["masked, reset pos"]["delta_vs_control"] is None
    assert arms["unmasked, continuous pos"]["delta_vs_control"]["verdict"] == "differs"
    # the arm loss is the token-weighted mean at the last validation, inside its own CI
    control = arms["masked, reset pos"]
    assert control["loss"] == pytest.approx(noisy(base, 1).mean(), rel=1e-9)
    assert control["ci"][0] < control["loss"] < control["ci"][1]
    # the per-document spread (sd 0.5 over 64 documents) sets the arm CI's width, about +-0.12
    assert 0.15 < control["ci"][1] - control["ci"][0] < 0.35


def test_the_control_pair_sets_a_training_noise_floor(tmp_path):
    """Trained masked arms drift apart by rounding (here 0.02 nats on every document): a gap of
    that size between other arms is training noise, a 0.1-nat gap is not."""
    base = doc_losses(0)
    write_arm(tmp_path, True, True, noisy(base, 1))
    write_arm(tmp_path, False, True, noisy(base, 2) + 0.02)
    write_arm(tmp_path, True, False, noisy(base, 3) + 0.015)
    write_arm(tmp_path, False, False, noisy(base, 4) + 0.1)
    summary = S.summarize(tmp_path, n_boot=2000)
    pairs = {(p["a"], p["b"]): p for p in summary["pairs"]}
    control = pairs["masked, continuous pos", "masked, reset pos"]
    assert control["verdict"] == "control" and control["ci"][0] > 0  # beyond document noise
    floor = summary["training_noise"]["floor"]
    assert 0.02 < floor < 0.04
    small = pairs["unmasked, reset pos", "masked, reset pos"]
    assert small["ci"][0] > 0 and small["verdict"] == "within training noise"
    assert pairs["unmasked, continuous pos", "masked, reset pos"]["verdict"] == "differs"
    assert f"training-noise floor {floor:.4f} nats" in S.format_summary(summary)


def test_a_sweep_without_the_control_pair_says_so(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, False, True, noisy(base, 1), group="packing_ablation")
    write_arm(tmp_path, False, True, noisy(base, 2) + 0.1, group="packing_ablation",
              packer="concat_chunk")  # fmt: skip
    summary = S.summarize(tmp_path, n_boot=500)
    assert summary["training_noise"] is None
    assert summary["pairs"][0]["verdict"] == "differs"
    assert "no rounding control" in S.format_summary(summary)


def test_paired_bootstrap_is_narrower_than_the_arms_own_cis(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, True, True, base)
    write_arm(tmp_path, False, True, noisy(base, 2))
    summary = S.summarize(tmp_path, n_boot=1000)
    (pair,) = summary["pairs"]
    pair_width = pair["ci"][1] - pair["ci"][0]
    arm_width = summary["arms"][0]["ci"][1] - summary["arms"][0]["ci"][0]
    assert pair_width < arm_width / 10  # documents' difficulty cancels in the paired difference


def test_seeds_give_a_spread_and_enter_the_ci(tmp_path):
    base = doc_losses(0)
    for seed, shift in ((0, 0.0), (1, 0.05)):
        write_arm(tmp_path, True, True, noisy(base, 10 + seed) + shift, seed=seed)
        write_arm(tmp_path, False, False, noisy(base, 20 + seed) + shift + 0.2, seed=seed)
    summary = S.summarize(tmp_path, n_boot=1000)
    arms = arms_by_name(summary)
    control = arms["masked, reset pos"]
    assert control["seeds"] == [0, 1] and len(control["seed_losses"]) == 2
    assert control["seed_sd"] == pytest.approx(0.05 / np.sqrt(2), abs=0.01)
    assert arms["unmasked, continuous pos"]["delta_vs_control"]["verdict"] == "differs"
    text = S.format_summary(summary)
    assert (
        "| masked, reset pos | 2 |" in text
        and "| a | b | a - b [95% CI] | seed-level t 95% CI (signs) | paired | verdict |" in text
    )


def test_position_bands_cover_each_bucket(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, True, True, base)
    write_arm(tmp_path, True, False, noisy(base, 1) + 0.3)
    bands = pd.DataFrame(S.summarize(tmp_path, n_boot=500)["positions"])
    assert sorted(bands["bucket_start"].unique()) == [0, 1, 2, 4]
    assert (bands["low"] <= bands["loss"]).all() and (bands["loss"] <= bands["high"]).all()
    assert set(bands["tokens"]) == {DOCS, 2 * DOCS, DOCS * (TOKENS - 4)}


def test_packing_arms_are_named_by_their_packer(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, False, True, base, packer="best_fit")
    write_arm(tmp_path, False, True, noisy(base, 1), packer="concat_chunk")
    names = {row["arm"] for row in S.summarize(tmp_path, n_boot=200)["arms"]}
    assert names == {"masked, continuous pos, best_fit", "masked, continuous pos, concat_chunk"}


def test_one_arm_is_reported_without_pairs(tmp_path):
    write_arm(tmp_path, True, True, doc_losses(0))
    summary = S.summarize(tmp_path, n_boot=200)
    assert summary["pairs"] == [] and len(summary["arms"]) == 1
    assert "one arm only: no pairwise comparison" in S.format_summary(summary)


def test_bad_input_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folders"):
        S.summarize(tmp_path)
    mixed = tmp_path / "mixed"
    write_arm(mixed, True, True, doc_losses(0), group="position_ablation")
    write_arm(mixed, False, True, doc_losses(0), group="packing_ablation")
    with pytest.raises(ValueError, match=r"mix group values \['packing_ablation', 'position_abl"):
        S.summarize(mixed)
    assert len(S.summarize(mixed, n_boot=100, allow_mixed=True)["pairs"]) == 1
    lengths = tmp_path / "lengths"
    write_arm(lengths, True, True, doc_losses(0), seq_len=1024)
    write_arm(lengths, False, True, doc_losses(0), seq_len=4096)
    with pytest.raises(ValueError, match=r"mix seq_len values \['1024', '4096'\]"):
        S.summarize(lengths)
    unvalidated = tmp_path / "unvalidated"
    run = write_arm(unvalidated, True, True, doc_losses(0))
    (run / "eval" / "held_out_documents.csv").unlink()
    with pytest.raises(FileNotFoundError, match="has no held-out document losses"):
        S.summarize(unvalidated)
    other_docs = tmp_path / "other_docs"
    write_arm(other_docs, True, True, doc_losses(0))
    write_arm(other_docs, False, True, doc_losses(0)[:10])
    with pytest.raises(ValueError, match="different held-out documents"):
        S.summarize(other_docs)


def test_cli_prints_the_tables_and_writes_summary_and_bands(tmp_path, capsys):
    root = tmp_path / "runs"
    base = doc_losses(0)
    for reset, mask in ((True, True), (False, True), (True, False), (False, False)):
        run = write_arm(root, reset, mask, noisy(base, int(reset) + 2 * int(mask)))
        metrics = [{"step": s, "train/loss": 3.0 - s / 10, "val/loss": 2.0,
                    "val/loss_by_abs_pos/0": 2.5, "val/loss_by_doc_pos/0": 2.5} for s in (10, 20)]  # fmt: skip
        (run / "csv").mkdir()
        pd.DataFrame(metrics).to_csv(run / "csv" / "metrics.csv", index=False)
    written = A.main([str(root), "--out", str(tmp_path / "fig.png"), "--bootstrap", "300"])
    assert {p.name for p in written} == {"fig.png", "fig.json", "fig_held_out.png",
                                         "fig_instances.csv.gz"}  # fmt: skip
    rows = pd.read_csv(tmp_path / "fig_instances.csv.gz")
    assert len(rows) == 4 * DOCS * 4 and set(rows["set"]) == {"held_out"}  # 4 runs x docs x buckets
    summary = json.loads((tmp_path / "fig.json").read_text())
    assert len(summary["arms"]) == 4 and len(summary["pairs"]) == 6
    out = capsys.readouterr().out
    assert "| arm | seeds | held-out loss [95% CI] |" in out and "unmasked, reset pos" in out


def test_arms_sharing_seeds_are_paired_by_seed(tmp_path):
    """Seed s of every arm continues from the same stage-1 run: a large seed effect (0.3 nats)
    shared by both arms cancels in the paired difference, which resampling each arm's seeds on
    its own (the bug of issue 42) does not: its interval would cover 0."""
    base = doc_losses(0)
    for seed, shift in ((0, 0.0), (1, 0.3), (2, -0.3)):
        write_arm(tmp_path, True, True, noisy(base, 10 + seed, 0.005) + shift, seed=seed)
        write_arm(tmp_path, False, False, noisy(base, 20 + seed, 0.005) + shift + 0.02, seed=seed)
    summary = S.summarize(tmp_path, n_boot=2000)
    (pair,) = summary["pairs"]
    assert pair["paired"] and pair["seeds"] == 3
    assert 0.01 < pair["ci"][0] < 0.02 < pair["ci"][1] < 0.03
    arm_width = np.subtract(*summary["arms"][0]["ci"][::-1])
    assert arm_width > 0.3  # the seeds' spread is in each arm's own interval
    # beside the bootstrap: the t interval over the three per-seed differences, in the tables
    level = pair["seed_level"]
    assert level["n"] == 3 and level["mean"] == pytest.approx(pair["delta"])
    assert level["t_ci"][0] < pair["delta"] < level["t_ci"][1] and level["positive"] == 3
    text = S.format_summary(summary)
    assert text.count(S.st.seed_level_text(pair)) == 2  # the arm table and the pairs table


def test_arms_on_other_seeds_are_compared_unpaired(tmp_path):
    base = doc_losses(0)
    write_arm(tmp_path, True, True, base, seed=0)
    write_arm(tmp_path, False, False, noisy(base, 1) + 0.1, seed=1)
    (pair,) = S.summarize(tmp_path, n_boot=500)["pairs"]
    assert not pair["paired"] and "no (other seeds)" in S.format_summary(
        S.summarize(tmp_path, n_boot=200)
    )


def write_answers(run, losses, steps=(10, 20)):
    """eval/held_out_answers.csv as longctx.eval.answer_loss writes it: per document (the tasks
    in turn), the loss sum over its answer tokens."""
    rows = [{"step": step, "doc": doc, "task": ("ood_ledger", "ood_echo")[doc % 2], "tokens": 7,
             "loss_sum": 7 * (loss + (0 if step == max(steps) else 9))}
            for step in steps for doc, loss in enumerate(losses)]  # fmt: skip
    pd.DataFrame(rows).to_csv(run / "eval" / "held_out_answers.csv", index=False)


def test_answer_token_loss_is_summarized_per_arm_and_pair(tmp_path):
    base, answers = doc_losses(0), np.linspace(0.5, 3.0, 32)
    for seed in (0, 1):
        write_answers(
            write_arm(tmp_path, True, True, noisy(base, seed), seed=seed),
            noisy(answers, 5 + seed, 0.01),
        )
        write_answers(write_arm(tmp_path, True, False, noisy(base, 2 + seed), seed=seed),
                      noisy(answers, 7 + seed, 0.01) + 1.0)  # fmt: skip
    summary = S.summarize(tmp_path, n_boot=1000)
    answers_summary = summary["answer_loss"]
    assert answers_summary["documents"] == 32 and answers_summary["answer_tokens"] == 32 * 7
    control = answers_summary["arms"][0]
    assert control["loss"] == pytest.approx(answers.mean(), abs=0.01)
    (pair,) = answers_summary["pairs"]
    assert pair["paired"] and pair["ci"][0] < 1.0 < pair["ci"][1] and pair["ci"][0] > 0.95
    echo = answers_summary["tasks"]["ood_echo"]  # the odd documents
    assert echo["documents"] == 16 and echo["answer_tokens"] == 16 * 7
    assert echo["arms"][0]["loss"] == pytest.approx(answers[1::2].mean(), abs=0.01)
    (echo_pair,) = echo["pairs"]
    assert echo_pair["paired"] and echo_pair["ci"][0] < 1.0 < echo_pair["ci"][1]
    text = S.format_summary(summary)
    assert "held-out answer tokens" in text and "| ood_echo (112) |" in text
    rows = S.per_instance(tmp_path)
    assert (rows["set"] == "answers").sum() == 4 * 32


def test_runs_without_answer_losses_have_none(tmp_path):
    write_arm(tmp_path, True, True, doc_losses(0))
    assert S.summarize(tmp_path, n_boot=100)["answer_loss"] is None
