"""The positive control and the position-ablation rerun end to end at toy size:
scripts/ruler_control.sh and scripts/position_ablation.sh (both arms / all eight runs, two steps
each, the suite's evaluation and the reports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import CACHE_DIR, ROOT


def run_script(name: str, tmp_path, env: dict, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
           "LONGCTX_CACHE": str(CACHE_DIR), "MIX_DOCUMENTS": "40", "SAMPLES": "1", **env}  # fmt: skip
    proc = subprocess.run(
        [str(ROOT / "scripts" / name), str(tmp_path / "runs"), *overrides],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
def test_the_positive_control_runs_both_arms_and_says_which_is_which(tmp_path):
    out = tmp_path / "control.json"
    small = ["trainer.max_steps=2", "trainer.val_check_interval=2", "data.val_rows=2",
             "trainer.limit_val_batches=1", "callbacks.ruler.samples=1"]  # fmt: skip
    run_script("ruler_control.sh", tmp_path, {"OUT": str(out)}, *small)
    summary = json.loads(out.read_text())
    assert summary["control_arm"] == summary["control"] == "ruler_control"
    assert [a["arm"] for a in summary["arms"]] == ["ruler_control", "ruler_control_nomix"]
    assert summary["instance_seed"] == 0 and summary["train_seed"] == 0
    assert summary["lengths"] == [192, 256, 512] and summary["training_length"] == 256
    for arm in summary["arms"]:
        assert "effective_length" in arm and arm["seeds"] == [0]
    assert out.with_suffix(".png").stat().st_size > 0
    # the two arms trained on what their experiments say
    runs = tmp_path / "runs" / "outputs" / "train"
    record = {a: json.loads((runs / a / "eval" / "ruler" / "ruler.json").read_text())
              for a in ("ruler_control", "ruler_control_nomix")}  # fmt: skip
    assert {r["instances_sha256"] for r in record.values()} == {
        record["ruler_control"]["instances_sha256"]
    }  # the same instances for both arms


@pytest.mark.slow
def test_the_position_ablation_rerun_scores_every_arm_and_seed(tmp_path):
    out = tmp_path / "ablation"
    # each run's folder is named by the overrides (hashed past a file name's limit); a few
    # held-out documents and answers per arm are still paired across the arms by the report
    small = ["data.val_rows=2", "trainer.limit_val_batches=1", "callbacks.ruler.samples=1",
             "callbacks.held_out_documents.num_documents=4", "callbacks.held_out_answers.documents=4"]  # fmt: skip
    env = {"SEQ": "512", "STEPS": "2", "OUT": str(out), "TASKS": "lc_passkey,lc_copy",
           "LENGTHS": "256 512"}  # fmt: skip
    run_script("position_ablation.sh", tmp_path, env, *small)
    summary = json.loads((tmp_path / "ablation_ruler.json").read_text())
    assert summary["control"] == "masked, reset pos" and summary["instance_seed"] == 0
    assert len(summary["arms"]) == 4 and all(a["seeds"] == [0, 1] for a in summary["arms"])
    assert len(summary["pairs"]) == 3 and summary["train_seeds"] == [0, 1]
    loss = json.loads((tmp_path / "ablation.json").read_text())
    assert len(loss["arms"]) == 4 and loss["runs"] == 8 and loss["documents"] == 4


@pytest.mark.parametrize(
    "script, setting",
    [("position_ablation.sh", "ROWS=0"), ("position_ablation.sh", "VAL_EVERY=nan"),
     ("position_ablation.sh", "INIT_FROM=/no/such/run"), ("context_extension.sh", "ROWS2=-1"),
     ("context_extension.sh", "STAGE1=/no/such/run"), ("ruler_control.sh", "PARALLEL=2"),
     ("evidence.sh", "SEEDS=abc"), ("evidence.sh", "SEEDS=0 -1"), ("evidence.sh", "SEQ1=abc"),
     ("evidence.sh", "INSTANCE_SEED=x")],
)  # fmt: skip
def test_a_bad_setting_is_refused_in_one_line_before_anything_is_written(tmp_path, script, setting):
    name, value = setting.split("=", 1)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "LONGCTX_CACHE": str(tmp_path / "cache"),
        name: value,
    }
    proc = subprocess.run([str(ROOT / "scripts" / script), str(tmp_path / "runs")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"error: {setting}")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_evidence_reports_with_nothing_archived_is_refused_before_anything_is_written(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out")}
    proc = subprocess.run([str(ROOT / "scripts" / "evidence.sh"), str(tmp_path / "runs"), "reports"],
                          env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(
        f"error: PART=reports with nothing archived in {tmp_path}/out/runs"
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()
