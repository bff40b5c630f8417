"""Scoring the suite RULER's way: its two metrics on hand cases, scoring by generation (rows in
input order, both columns kept), RULER's effective length on its README's rows, the relative
rule beside it, and their bootstrap intervals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.data import ByteTokenizer
from longctx.eval.ruler import (
    RulerInputError,
    relative_effective_length,
    ruler_effective_length,
    score_instances,
    string_match_all,
    string_match_part,
    summarize,
)
from longctx.eval.ruler.effective_length import bootstrap_effective_length
from longctx.eval.ruler.instances import Instance
from longctx.eval.ruler.metrics import ruler_metric
from longctx.model import Llama, LlamaConfig
from longctx.model.generate import greedy_generate
from longctx.synthetic.tasks import RULER_TASKS

TOK = ByteTokenizer()


# ------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize(
    "prediction, expected",
    [
        ("1234567, 7654321", 1.0),
        ("7654321 and 1234567", 1.0),  # another order, " and " between them
        (" The special magic numbers are: 1234567 and 7654321.", 1.0),  # a preamble
        ("only 7654321", 0.5),  # partial credit
        ("91234567 x", 0.5),  # inside a longer number: RULER's substring rule credits it
        ("", 0.0),
        ("12345 67", 0.0),
    ],
)
def test_string_match_all(prediction, expected):
    assert string_match_all(prediction, ["1234567", "7654321"]) == expected


def test_string_match_is_case_insensitive_both_ways():
    assert string_match_all("the words: APPLE, Pear", ["apple", "pear", "plum"]) == 2 / 3
    assert string_match_all("apple", ["APPLE"]) == 1.0
    assert string_match_part("It was in PARIS.", ["Paris", "France"]) == 1.0
    assert string_match_part("Lyon", ["Paris", "France"]) == 0.0


def test_ruler_metric_refuses_what_it_cannot_score():
    with pytest.raises(RulerInputError, match="unknown metric .'exact'."):
        ruler_metric("exact", "x", ["x"])
    with pytest.raises(RulerInputError, match="without references"):
        ruler_metric("string_match_all", "x", [])


# --------------------------------------------------------------------- instances, models
def instance(task, length, sample, answer, references, metric="string_match_all", gen=8):
    """An instance of ``length`` tokens: a prompt of noise (length - gen tokens), then the
    answer the teacher-forced mode scores."""
    rng = np.random.default_rng(sample + 10 * length)
    prompt = rng.integers(97, 123, length - gen)  # lowercase letters
    answer_ids = TOK.encode(" " + answer)
    return Instance(
        task=task, length=length, depth=0.5, sample=sample, seed=0,
        tokens=np.concatenate([prompt, answer_ids]).astype(np.int64), answer=answer,
        answer_len=len(answer_ids), references=tuple(references), metric=metric,
        tokens_to_generate=gen,
    )  # fmt: skip


class Oracle(torch.nn.Module):
    """Teacher-forced: all logit mass on the label."""

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        b, n = batch.shape
        target = torch.where(batch.labels == IGNORE_INDEX, 0, batch.labels)
        return torch.full((b, n, 259), -1e4).scatter(2, target[..., None], 1e4)


class Writer(Oracle):
    """Generates a fixed text per prompt (keyed by the prompt's first 8 tokens), then EOS."""

    def __init__(self, texts: dict[tuple, str]) -> None:
        super().__init__()
        self.texts = texts
        self.calls: list[tuple[int, int]] = []

    def generate_from_batch(self, batch: PackedBatch, max_new_tokens: int) -> list[list[int]]:
        self.calls.append((batch.shape[1], max_new_tokens))
        out = []
        for row in batch.tokens.tolist():
            ids = list(TOK.encode(self.texts[tuple(row[:8])])) + [TOK.eos_id] + [65] * 50
            out.append(ids[:max_new_tokens])
        return out


def key(p) -> tuple:
    return tuple(int(t) for t in p.prompt[:8])


# ------------------------------------------------------------------- scoring by generation
def test_generation_is_scored_with_rulers_metric_beside_the_teacher_forced_match():
    cases = [
        # (answer as the template writes it, references, what the model writes, RULER, TF)
        ("1234567, 7654321", ["1234567", "7654321"], "7654321 and 1234567", 1.0, True),
        ("apple pear", ["apple", "pear"], "PEAR", 0.5, True),
        ("Paris", ["Paris", "the capital"], "I think it is paris", 1.0, True),
        ("Paris", ["Paris"], "Lyon", 0.0, True),
    ]
    instances = [
        instance("t", 64, i, a, refs, "string_match_part" if i == 2 else "string_match_all", 40)
        for i, (a, refs, *_) in enumerate(cases)
    ]
    writer = Writer({key(p): c[2] for p, c in zip(instances, cases, strict=True)})
    rows = score_instances(writer, instances, batch_size=3, scoring="generate", tokenizer=TOK)
    for row, (_, refs, text, score, tf) in zip(rows, cases, strict=True):
        assert row["prediction"] == text  # cut at the EOS, decoded
        assert row["score"] == score
        assert row["correct_teacher_forced"] is tf  # the oracle is teacher-forced right
        assert json.loads(row["references"]) == refs
        assert row["scoring"] == "generate"
    assert writer.calls == [(len(instances[0].prompt), 40)] * 2  # batches of 3 then 1


def test_rows_come_back_in_input_order():
    """Interleaved lengths and generation lengths: batched apart, returned as given."""
    specs = [(96, 0, 8), (64, 1, 8), (96, 2, 16), (64, 3, 8), (96, 4, 8), (64, 5, 16)]
    instances = [instance(f"t{s}", n, s, f"v{s}", [f"v{s}"], gen=g) for n, s, g in specs]
    writer = Writer({key(p): f"v{p.sample}" for p in instances})
    for scoring in ("teacher_forced", "generate"):
        rows = score_instances(writer, instances, batch_size=2, scoring=scoring, tokenizer=TOK)
        assert [(r["task"], r["length"], r["sample"]) for r in rows] == [
            (f"t{s}", n, s) for n, s, _ in specs
        ]
        assert all(r["score"] == 1.0 for r in rows)


def test_the_real_model_is_scored_on_its_own_greedy_text():
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(vocab_size=259, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                    attn_backend="sdpa", init_std=0.2)
    ).eval()  # fmt: skip
    instances = [instance("t", 48, s, "7", ["7"], gen=6) for s in range(3)]
    rows = score_instances(model, instances, batch_size=2, scoring="generate", tokenizer=TOK)
    for row, p in zip(rows, instances, strict=True):
        ids = greedy_generate(model, p.prompt, 6)
        text = TOK.decode(ids[: ids.index(TOK.eos_id)] if TOK.eos_id in ids else ids)
        assert row["prediction"] == text
        assert row["score"] == string_match_all(text, ["7"])


def test_generation_needs_a_tokenizer_and_a_known_mode():
    p = instance("t", 32, 0, "x", ["x"])
    with pytest.raises(RulerInputError, match="pass tokenizer"):
        score_instances(Oracle(), [p], scoring="generate")
    with pytest.raises(RulerInputError, match="scoring='beam'"):
        score_instances(Oracle(), [p], scoring="beam")


# ----------------------------------------------------------------------- effective length
# RULER's README (NVIDIA/RULER): the 4K ... 128K scores and the effective length it states
README_ROWS = {
    "Llama3.1-8B": ([95.5, 93.8, 91.6, 87.4, 84.7, 77.0], 32),
    "GLM3-6B": ([87.8, 83.4, 78.6, 69.9, 56.0, 42.0], 4),
    "LWM-7B": ([82.3, 78.4, 73.7, 69.1, 68.1, 65.0], None),
    "Gemini-1.5-pro": ([96.7, 95.8, 96.0, 95.9, 95.9, 94.4], 128),  # ">128K": all of the grid
    "GPT-4-1106-preview": ([96.6, 96.3, 95.2, 93.2, 87.0, 81.2], 64),
    "Llama3.1-70B": ([96.5, 95.8, 95.4, 94.8, 88.4, 66.6], 64),
    "Qwen2-72B": ([96.9, 96.1, 94.9, 94.1, 79.8, 53.7], 32),
    "GLM4-9B": ([94.7, 92.8, 92.1, 89.9, 86.7, 83.1], 64),
    "GradientAI-Llama3-70B": ([95.1, 94.4, 90.8, 85.4, 80.9, 72.1], 16),
    "Phi3-medium-14B": ([93.3, 93.2, 91.1, 86.8, 78.6, 46.1], 32),
}
K = 1024
GRID = [4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K]


@pytest.mark.parametrize("model", list(README_ROWS))
def test_rulers_effective_length_matches_its_readme(model):
    scores, expected = README_ROWS[model]
    found = ruler_effective_length({n: s / 100 for n, s in zip(GRID, scores, strict=True)})
    assert found == (None if expected is None else expected * K)


def test_the_threshold_is_strict_and_the_scale_is_fractions():
    assert ruler_effective_length({4 * K: 0.856}) is None  # Llama-2-7B at 4K: the bar itself
    assert ruler_effective_length({4 * K: 0.857, 8 * K: 0.5}) == 4 * K
    # the literal reading: a length after a failing one counts when it exceeds the bar
    assert ruler_effective_length({4 * K: 0.80, 8 * K: 0.90}) == 8 * K
    with pytest.raises(RulerInputError, match=r"outside \[0, 1\].*percentages / 100"):
        ruler_effective_length({4 * K: 95.5})


def test_the_relative_rule_is_anchored_and_monotone():
    scores = {256: 0.6, 512: 1.0, 1024: 0.9, 2048: 0.5, 4096: 0.95}
    found = relative_effective_length(scores, anchor=512, chance_level=0.1)
    assert found.threshold == pytest.approx(0.85)
    assert found.length is None  # 256 is already below 0.85 x the anchor's 1.0
    found = relative_effective_length(scores, anchor=256, chance_level=0.1)
    assert found.threshold == pytest.approx(0.51) and found.length == 1024  # not 4096
    assert "training length 256" in found.rule
    with pytest.raises(RulerInputError, match="anchored at the training length .8192."):
        relative_effective_length(scores, anchor=8192, chance_level=0.1)


def rows_for(task_scores: dict[tuple[str, int], list[float]]) -> list[dict]:
    return [
        {"task": t, "length": n, "depth": 0.5, "sample": i, "score": s, "scoring": "generate",
         "correct_teacher_forced": s == 1.0, "token_accuracy": s, "distance": None}
        for (t, n), scores in task_scores.items() for i, s in enumerate(scores)
    ]  # fmt: skip


def test_the_bootstrap_interval_brackets_the_effective_length():
    sure = {(t, n): [1.0] * 10 for t in RULER_TASKS[:2] for n in (4 * K, 8 * K)}
    assert bootstrap_effective_length(rows_for(sure), RULER_TASKS[:2], ruler_effective_length) == (
        8 * K,
        8 * K,
    )
    # at 8K one task is right 9 times in 10: the suite score 0.95 passes, but a replicate can
    # draw 0.7 (0.85 suite): the interval reaches down to 4K
    shaky = {**sure, (RULER_TASKS[0], 8 * K): [1.0] * 9 + [0.0]}
    low, high = bootstrap_effective_length(rows_for(shaky), RULER_TASKS[:2], ruler_effective_length)
    assert (low, high) == (4 * K, 8 * K)


def test_summarize_reports_rulers_and_the_relative_length_side_by_side():
    scores = {(t, n): [1.0] * 4 for t in RULER_TASKS[:3] for n in (512, 1024)}
    scores[(RULER_TASKS[0], 1024)] = [0.0] * 4  # suite 2/3 at 1024
    report = summarize(rows_for(scores), anchor=512)
    ruler, relative = report["effective_length"]["ruler"], report["effective_length"]["relative"]
    assert ruler["length"] == 512 and ruler["tasks"] == list(RULER_TASKS[:3])
    assert ruler["missing_tasks"] == list(RULER_TASKS[3:])  # the mean is over the tasks run
    assert ruler["missing_at"] == {}
    short = [
        r for r in rows_for(scores) if not (r["task"] == RULER_TASKS[2] and r["length"] == 512)
    ]
    assert summarize(short)["effective_length"]["ruler"]["missing_at"] == {512: [RULER_TASKS[2]]}
    assert relative["anchor"] == 512 and relative["length"] == 512
    assert [r["score"] for r in report["suite"]] == [1.0, pytest.approx(2 / 3)]
