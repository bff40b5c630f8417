"""studies.ruler_report's statistics: arms paired by training seed (the hierarchical
bootstrap of studies.statistics), per-task differences, and the files beside the JSON."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from helpers import write_run_record

from studies import ruler_report as report

TASKS, LENGTHS, SAMPLES = ("lc_passkey", "lc_copy"), (64, 128), 10
SEED_LEVEL = {0: 0.2, 1: 0.5, 2: 0.8}  # a large seed effect, shared by both arms


def fake_run(root, arm: str, seed: int, shift: float) -> None:
    """One run's final suite results: RULER-style partial scores, the seed's level plus a fixed
    per-instance offset, plus ``shift``."""
    run = write_run_record(root / f"{arm}_s{seed}", {"seq_len": 128}, arm, seed)
    offsets = np.random.default_rng(7).uniform(-0.15, 0.15, len(TASKS) * len(LENGTHS) * SAMPLES)
    keys = [(t, n, s) for t in TASKS for n in LENGTHS for s in range(SAMPLES)]
    rows = [{"step": 3, "seed": 0, "task": t, "length": n, "depth": 0.5, "sample": s,
             "score": SEED_LEVEL[seed] + o + shift, "correct_teacher_forced": False}
            for (t, n, s), o in zip(keys, offsets, strict=True)]  # fmt: skip
    (run / "eval").mkdir()
    pd.DataFrame(rows).to_csv(run / "eval" / "ruler_results.csv", index=False)


def test_arms_sharing_seeds_are_paired_per_length_and_task(tmp_path):
    for seed in SEED_LEVEL:
        fake_run(tmp_path, "base", seed, 0.0)
        fake_run(tmp_path, "worse", seed, -0.1)
    out = tmp_path / "summary.json"
    summary = report.main([str(tmp_path), "--arm-by", "group", "--control", "base",
                           "--json", str(out), "--bootstrap", "1000"])  # fmt: skip
    (pair,) = summary["pairs"]
    for row in pair["by_length"] + pair["by_task"]:
        assert row["paired"] and row["seeds"] == 3
        assert abs(row["delta"] + 0.1) < 1e-9 and abs(row["ci"][0] + 0.1) < 1e-9
        assert row["verdict"] == "differs"
        level = row["seed_level"]  # beside it, the t interval over the per-seed differences
        assert level["n"] == 3 and level["negative"] == 3 and abs(level["mean"] + 0.1) < 1e-9
    assert "seed-level [-0.10, -0.10] (0+ 3−)" in summary["markdown"]
    assert {(r["task"], r["length"]) for r in pair["by_task"]} == {
        (t, n) for t in TASKS for n in LENGTHS
    }
    base = summary["arms"][0]
    width = base["suite"][0]["ci"][1] - base["suite"][0]["ci"][0]
    assert width > 0.3  # the seeds' spread is in the arm's own interval
    assert set(base["seed_scores"]) == {0, 1, 2} and set(base["seed_scores"][1]) == {64, 128}
    # beside the JSON: per instance and per seed
    instances = pd.read_csv(tmp_path / "summary_instances.csv.gz")
    assert len(instances) == 2 * 3 * len(TASKS) * len(LENGTHS) * SAMPLES
    seeds = pd.read_csv(tmp_path / "summary_seeds.csv")
    assert len(seeds) == 2 * 3 * len(LENGTHS) and set(seeds["seed"]) == {0, 1, 2}
    row = seeds[(seeds["arm"] == "worse") & (seeds["seed"] == 2) & (seeds["length"] == 64)]
    own = instances[(instances["arm"] == "worse") & (instances["seed_train"] == 2)
                    & (instances["length"] == 64)]  # fmt: skip
    assert abs(row["score"].item() - own.groupby("task")["score"].mean().mean()) < 1e-9
    assert json.loads(out.read_text())["pairs"][0]["by_task"]


def test_arms_on_other_seeds_are_compared_unpaired(tmp_path):
    fake_run(tmp_path, "base", 0, 0.0)
    fake_run(tmp_path, "other", 1, 0.0)
    summary = report.summarize(tmp_path, "group", "base", n_boot=200)
    (pair,) = summary["pairs"]
    assert not any(r["paired"] for r in pair["by_length"])
    assert "(unpaired)" in summary["markdown"]
