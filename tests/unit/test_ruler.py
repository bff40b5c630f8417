"""The effective-length suite (longctx.eval.ruler): its controls, determinism, the threshold rule,
scoring a transformers export, the in-loop callback and every refusal."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import CACHE_DIR, write_run_record

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data import ByteTokenizer
from longctx.eval import cli
from longctx.eval.ruler import (
    RulerInputError,
    cell_table,
    chance,
    make_instance,
    make_instances,
    relative_effective_length,
    score_instances,
    summarize,
    tokens_digest,
    wilson,
    write_instances,
)
from longctx.eval.ruler.instances import Instance
from longctx.synthetic.tasks import SUITE_TASKS

TOK = ByteTokenizer()
# the tasks an induction model (copy what followed the longest earlier match) solves exactly
INDUCTION_TASKS = ["lc_passkey", "lc_niah_single", "lc_niah_multikey", "lc_copy"]
# the teacher-forced controls run on longctx's own formats (RULER's: tests/unit/test_ruler_tasks.py)
LC_TASKS = [t for t in SUITE_TASKS if t.startswith("lc_")]


# ----------------------------------------------------------------------- control models
class Oracle(torch.nn.Module):
    """Knows every answer: all logit mass on the label."""

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        b, n = batch.shape
        target = torch.where(batch.labels == IGNORE_INDEX, 0, batch.labels)
        return torch.full((b, n, 259), -1e4).scatter(2, target[..., None], 1e4)


class Bigram(torch.nn.Module):
    """Ignores the context: its prediction depends on the current token only."""

    def __init__(self, next_token: dict[int, int] | None = None) -> None:
        super().__init__()
        self.table = torch.zeros(259, dtype=torch.long)
        for current, following in (next_token or {}).items():
            self.table[current] = following

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        predicted = self.table[batch.tokens]
        return torch.nn.functional.one_hot(predicted, 259).float()


class Induction(torch.nn.Module):
    """Reads the context: predicts the token that followed the latest earlier position whose
    preceding tokens match the current suffix longest (an idealised induction head)."""

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        out = torch.zeros(*batch.shape, 259)
        for row, (tokens, labels) in enumerate(zip(batch.tokens, batch.labels, strict=True)):
            tokens = tokens.numpy()
            for i in np.flatnonzero(labels.numpy() != IGNORE_INDEX):
                out[row, i, self._next(tokens, i)] = 1.0
        return out

    @staticmethod
    def _next(tokens: np.ndarray, i: int) -> int:
        candidates = np.flatnonzero(tokens[:i] == tokens[i])
        back = 1
        while len(candidates) > 1 and back <= i:
            keep = candidates[candidates - back >= 0]
            keep = keep[tokens[keep - back] == tokens[i - back]]
            if len(keep) == 0:
                break
            candidates, back = keep, back + 1
        return int(tokens[candidates[-1] + 1]) if len(candidates) else 0


def shuffled_context(instance: Instance, seed: int) -> Instance:
    """The instance with its context (everything before the question) permuted: the needle is
    scattered, the question and answer stay."""
    tokens = instance.tokens.copy()
    cut = len(tokens) - instance.answer_len - instance.question_len
    tokens[:cut] = np.random.default_rng(seed).permutation(tokens[:cut])
    return Instance(**{**instance.__dict__, "tokens": tokens, "reference": None})


def accuracy(results, task=None) -> float:
    rows = [r for r in results if task is None or r["task"] == task]
    return sum(r["correct_teacher_forced"] for r in rows) / len(rows)


# ------------------------------------------------------------------------------ controls
@pytest.fixture(scope="module")
def every_task():
    return make_instances(TOK, LC_TASKS, [512, 768], depths=[0.0, 0.5, 1.0], samples=2,
                          haystack="books", cache_dir=str(CACHE_DIR))  # fmt: skip


def test_an_oracle_scores_every_task_perfectly(every_task):
    results = score_instances(Oracle(), every_task, batch_size=5)
    assert len(results) == len(every_task) == len(LC_TASKS) * 2 * 3 * 2
    assert all(r["correct_teacher_forced"] and r["token_accuracy"] == 1.0 for r in results)
    report = summarize(results, anchor=512)
    assert report["effective_length"]["relative"]["length"] == 768
    assert all(c["score"] == 1.0 and c["ci_high"] == 1.0 for c in report["cells"])
    assert all(r["n"] == 54 and r["ci_low"] > 0.9 for r in report["suite"])


def test_a_context_blind_model_scores_at_chance(every_task):
    results = score_instances(Bigram(), every_task, batch_size=5)
    for row in summarize(results)["lengths"]:
        assert row["ci_low"] <= chance(row["task"]) <= row["ci_high"], row
    found = summarize(results, anchor=512)["effective_length"]
    assert found["relative"]["length"] is None
    assert found["ruler"] is None or found["ruler"]["length"] is None
    # a one-digit passkey has chance 1/10: a guesser that knows the format (" ", then a digit)
    # but not the context gets that, within its interval
    probes = make_instances(TOK, ["lc_passkey"], [96], [0.0, 0.5, 1.0], 100, digits=1,
                            haystack="noise")  # fmt: skip
    guess = Bigram({ord("s"): ord(" "), ord(" "): ord("7")})
    table = cell_table(score_instances(guess, probes, batch_size=50))
    hits = sum(round(c["score"] * c["n"]) for c in table)
    low, high = wilson(hits, len(probes))
    assert low <= chance("lc_passkey", digits=1) == 0.1 <= high
    assert 0 < hits < len(probes) / 4  # the guess is right sometimes, not always


@pytest.mark.parametrize("task", INDUCTION_TASKS)
def test_shuffling_the_needle_out_drops_a_reading_model_to_chance(task, every_task):
    instances = [i for i in every_task if i.task == task]
    assert accuracy(score_instances(Induction(), instances)) == 1.0
    shuffled = [shuffled_context(i, seed) for seed, i in enumerate(instances)]
    results = score_instances(Induction(), shuffled)
    low, high = wilson(sum(r["correct_teacher_forced"] for r in results), len(results))
    assert accuracy(results) == 0.0 and low <= chance(task) <= high


def test_copy_scores_the_repeat_against_its_first_occurrence(every_task):
    copies = [i for i in every_task if i.task == "lc_copy"]
    results = score_instances(Induction(), copies)
    assert all(r["token_accuracy"] == 1.0 for r in results)
    # the first occurrence is random letters: nothing earlier predicts them
    assert np.mean([r["reference_token_accuracy"] for r in results]) < 0.3
    for i in copies:
        start, stop = i.reference
        assert np.array_equal(i.tokens[start:stop], i.tokens[-i.answer_len :])
        assert i.distance == len(i.tokens) - i.answer_len - start
    curve = summarize(results)["copy_curve"]
    assert [c["distance_bucket"] for c in curve] == sorted(c["distance_bucket"] for c in curve)
    assert max(c["mean_distance"] for c in curve) > 0.8 * 768  # depth 0: across the context


# --------------------------------------------------------------------------- generation
def test_every_instance_is_exact(every_task):
    for i in every_task:
        assert len(i.prompt) == i.length - max(i.tokens_to_generate, i.answer_len)
        labels = i.labels()
        assert (labels != IGNORE_INDEX).sum() == i.answer_len + i.reference_len
        answer = TOK.decode(i.tokens[-i.answer_len :])
        assert answer.strip() == i.answer  # the answer text is what is scored
        if i.task not in ("lc_common_words", "lc_frequent_words"):
            assert TOK.decode(i.tokens[: -i.answer_len]).count(i.answer.split(", ")[0]) >= 1


def test_the_common_and_frequent_word_answers_are_right():
    for seed in range(3):
        cwe = make_instance("lc_common_words", TOK, 600, 0.5, seed)
        words = TOK.decode(cwe.tokens[: -cwe.answer_len - cwe.question_len])
        listed = [w.strip() for w in words.split("Words:")[1].split(",") if w.strip()]
        counts = pd.Series(listed).value_counts()
        common = cwe.answer.split(", ")
        assert set(counts.index[:5]) == set(common) and counts.iloc[4] > counts.iloc[5]
        assert common == sorted(common, key=listed.index)  # in order of first appearance
        fwe = make_instance("lc_frequent_words", TOK, 600, 0.5, seed)
        coded = TOK.decode(fwe.tokens[: -fwe.answer_len - fwe.question_len])
        counts = pd.Series(coded.split("Coded text:")[1].split()).value_counts()
        assert list(counts.index[:3]) == fwe.answer.split(", ")
        assert counts.iloc[0] > counts.iloc[1] > counts.iloc[2] > counts.iloc[3]


def test_the_needle_sits_at_its_depth_between_sentences():
    for depth in (0.0, 0.3, 1.0):
        i = make_instance("lc_niah_single", TOK, 1000, depth, seed=2, haystack="noise")
        context = TOK.decode(i.tokens[: -(i.answer_len + i.question_len)])
        needle = context.index(" The magic number for")
        assert needle == 0 or context[:needle].endswith(".")  # after a whole sentence
        assert abs(needle / len(context) - depth) < 0.2


# the token ids of a few instances, hashed: any machine, any Python gives these
PINNED = {
    "noise": "98276c38bdfeadf11494bffabf1306e81597e0b776276fb4b89c4ba4711e9bad",
    "books": "106c53cd37b43881b2773bbc882c348ab785270458fc8f4c68b7af61b7c075a8",
}


@pytest.mark.parametrize("haystack", ["noise", "books"])
def test_the_same_seed_gives_the_same_instances_on_any_machine(haystack):
    def draw(seed):
        return make_instances(TOK, ["lc_passkey", "lc_niah_multikey", "lc_variable_tracking", "lc_copy"],
                              [384], [0.25, 0.75], 2, seed, haystack, str(CACHE_DIR))  # fmt: skip

    first = draw(0)
    assert tokens_digest(first) == tokens_digest(draw(0)) == PINNED[haystack]
    other = draw(1)
    assert all(not np.array_equal(a.tokens, b.tokens) for a, b in zip(first, other, strict=True))


def test_instances_are_written_out_with_text_and_answer(tmp_path):
    instances = make_instances(
        TOK, ["lc_niah_single", "lc_copy"], [200], [0.5], 2, haystack="noise"
    )
    path = write_instances(instances, TOK, tmp_path / "instances.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4
    for row, i in zip(rows, instances, strict=True):
        assert row["context"] + row["question"] + row["answer_text"] == TOK.decode(i.tokens)
        assert row["answer_text"].strip() == row["answer"] == i.answer
        assert row["tokens_sha256"] == tokens_digest([i])


# ------------------------------------------------------------------------ effective length
@pytest.mark.parametrize(
    "scores, expected, threshold",
    [
        ({256: 1.0, 512: 0.95, 1024: 0.9, 2048: 0.5}, 1024, 0.85),  # RULER's bar for a strong model
        ({256: 0.4, 512: 0.36, 1024: 0.3}, 512, 0.34),  # a small model: 0.85 x its own 0.4
        ({256: 0.9, 512: 0.5, 1024: 0.9}, 256, 0.765),  # the score must stay: a dip ends it
        ({256: 0.22, 512: 0.21, 1024: 0.1}, 512, 0.2),  # the floor above chance binds
        ({256: 0.1, 512: 0.1}, None, 0.2),  # at chance everywhere: no effective length
        ({1024: 0.8, 256: 0.8, 512: 0.8}, 1024, 0.68),  # lengths in any order
    ],
)
def test_the_effective_length_rule(scores, expected, threshold):
    found = relative_effective_length(scores, anchor=256, chance_level=0.0)
    assert found.length == expected and found.threshold == pytest.approx(threshold)
    assert f"= {threshold:.3f}" in found.rule


def test_the_effective_length_floor_is_above_chance():
    assert relative_effective_length({8: 0.6, 16: 0.55}, 8, chance_level=0.5).length is None
    assert relative_effective_length({8: 0.75, 16: 0.7}, 8, chance_level=0.5).length == 16


def test_wilson_interval():
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-4) and high == pytest.approx(0.7634, abs=1e-4)
    assert all(math.isnan(v) for v in wilson(0, 0))


# ------------------------------------------------------------------------------ bad input
def test_bad_input_names_the_value(tmp_path):
    with pytest.raises(RulerInputError, match=r"unknown task \('nope'\); expected some of"):
        make_instances(TOK, "lc_passkey,nope", [256])
    with pytest.raises(
        RulerInputError, match=r"lc_niah_multikey length=100 is too short \(its .* take"
    ):
        make_instance("lc_niah_multikey", TOK, 100, 0.5, 0)
    with pytest.raises(RulerInputError, match=r"lc_common_words length=20 is too short"):
        make_instance("lc_common_words", TOK, 20, 0.5, 0)
    for depth in (1.5, -0.1):
        with pytest.raises(RulerInputError, match=rf"depth={depth}; expected a fraction in"):
            make_instance("lc_passkey", TOK, 256, depth, 0)
    with pytest.raises(RulerInputError, match=r"haystack folder does not exist \(.*missing\)"):
        make_instances(TOK, ["lc_passkey"], [256], haystack=str(tmp_path / "missing"))


def test_a_haystack_smaller_than_the_length_is_repeated(tmp_path):
    from longctx.data.prepare import prepare

    (tmp_path / "small.txt").write_text("A short corpus of a few words. " * 20)
    prepare([tmp_path / "small.txt"], tmp_path / "small", "byte", val_fraction=0.0,
            progress=False)  # fmt: skip
    # RULER repeats its essays when a length needs more: so does a corpus haystack
    (i,) = make_instances(TOK, ["lc_passkey"], [4096], [0.5], 1, haystack=str(tmp_path / "small"))
    assert TOK.decode(i.prompt).count("A short corpus of a few words.") > 100


def test_the_command_line_answers_bad_input_in_one_line(tmp_path, capsys):
    (tmp_path / "nohf").mkdir()
    with pytest.raises(SystemExit) as exit_:
        cli.cli(["--hf", str(tmp_path / "nohf"), "--suite", "ruler"])
    assert exit_.value.code == 2
    assert "error: --hf folder has no config.json" in capsys.readouterr().err
    from transformers import ViTConfig

    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(SystemExit):
        cli.cli(["--hf", str(tmp_path / "vit"), "--suite", "ruler"])
    err = capsys.readouterr().err
    assert "error: --hf architecture cannot be scored" in err and "model_type='vit'" in err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "not-a-model"}')
    with pytest.raises(SystemExit):
        cli.cli(["--hf", str(tmp_path / "odd"), "--suite", "ruler"])
    assert "model_type='not-a-model'" in capsys.readouterr().err


def test_the_callback_refuses_bad_settings_before_training():
    from types import SimpleNamespace

    from longctx.data import DataConfig
    from longctx.eval.ruler.callback import RulerEval, default_ruler_lengths

    datamodule = SimpleNamespace(
        config=DataConfig(seq_len=1024, cache_dir=str(CACHE_DIR)),
        tokenizer=ByteTokenizer,  # the run's tokenizer (LongCtxDataModule.tokenizer)
    )
    trainer = SimpleNamespace(datamodule=datamodule)
    module = SimpleNamespace(model_config=SimpleNamespace(max_seq_len=2048))
    assert default_ruler_lengths(1024, 2) == [256, 512, 1024, 2048]
    with pytest.raises(ValueError, match=r"evaluation length 4096 \(RulerEval length\) exceeds"):
        RulerEval(factor=4).setup(trainer, module, "fit")
    with pytest.raises(RulerInputError, match=r"unknown task \('bogus'\)"):
        RulerEval(tasks=["bogus"]).setup(trainer, module, "fit")
    with pytest.raises(RulerInputError, match=r"depth=2.0"):
        RulerEval(tasks=["lc_passkey"], depths=[2.0]).setup(trainer, module, "fit")
    callback = RulerEval(tasks=["lc_passkey", "lc_copy"], lengths=[256, 512], samples=1)
    callback.setup(trainer, module, "fit")
    assert len(callback.instances) == 2 * 2 * 3


def fake_sweep(root, correct_at) -> None:
    """Run folders as a sweep leaves them: two arms (W&B groups) x two seeds, scored alike."""
    for arm, lengths_right in correct_at.items():
        for seed in (0, 1):
            run = write_run_record(root / f"{arm}_s{seed}", {"seq_len": 128}, arm, seed)
            rows = [
                {"step": step, "seed": 0, "task": task, "length": n, "depth": d, "sample": s,
                 "score": float(step == 9 and n in lengths_right),
                 "correct_teacher_forced": step == 9 and n in lengths_right}
                for step in (5, 9) for task in ("lc_passkey", "lc_copy") for n in (64, 128)
                for d in (0.0, 1.0) for s in range(5)
            ]  # fmt: skip
            (run / "eval").mkdir()
            pd.DataFrame(rows).to_csv(run / "eval" / "ruler_results.csv", index=False)


def test_the_sweep_report_pairs_arms_over_instances_and_seeds(tmp_path):
    from studies import ruler_report as report

    fake_sweep(tmp_path, {"mix": (64, 128), "nomix": (64,)})
    out = tmp_path / "summary.json"
    summary = report.main([str(tmp_path), "--arm-by", "group", "--control", "mix",
                           "--json", str(out), "--note", "fake"])  # fmt: skip
    assert json.loads(out.read_text())["control"] == "mix" and out.with_suffix(".png").is_file()
    arms = {a["arm"]: a for a in summary["arms"]}
    assert arms["mix"]["effective_length"] == 128 and arms["nomix"]["effective_length"] == 64
    assert arms["nomix"]["seed_effective_lengths"] == {0: 64, 1: 64}
    assert arms["nomix"]["task_effective_lengths"] == {"lc_copy": 64, "lc_passkey": 64}
    assert arms["mix"]["seeds"] == [0, 1] and summary["instance_seed"] == 0
    (pair,) = summary["pairs"]
    by_length = {r["length"]: r for r in pair["by_length"]}
    assert by_length[64]["delta"] == 0.0 and by_length[64]["verdict"] == "within noise"
    assert by_length[128]["delta"] == -1.0 and by_length[128]["ci"] == [-1.0, -1.0]
    assert by_length[128]["verdict"] == "differs"
