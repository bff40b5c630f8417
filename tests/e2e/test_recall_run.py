"""The recall study end to end: train.py experiment=recall on an MQAR corpus written into the
cache, then python -m studies.recall on the run (per-instance CSV and JSON)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from helpers import ROOT, run_train

from longctx.synthetic.mqar import MqarSpec
from studies.recall import length_distances


@pytest.mark.slow
def test_a_trained_recall_run_is_scored_per_instance(tmp_path):
    tiny = ["logger=csv", "data.seq_len=256", "data.val_rows=1", "data.micro_batch_size=2",
            "trainer.max_steps=3", "trainer.val_check_interval=3",
            "trainer.enable_progress_bar=false", f"paths.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    stage1 = "data.shards=[{mqar: {documents: 500, seed: 0, val_documents: 50, max_pairs: 4}}]"
    run_train(["experiment=recall_stage1", "run_name=s1", stage1, *tiny], tmp_path)
    run_train(["experiment=recall", "run_name=r", f"model.init_from={tmp_path}/outputs/train/s1",
               "data.shards=[{mqar: {documents: 500, seed: 0, val_documents: 50}}]", *tiny],
              tmp_path)  # fmt: skip
    assert len(list((tmp_path / "cache").glob("mqar_s0_*/manifest.json"))) == 2
    run, out = tmp_path / "outputs" / "train" / "r", tmp_path / "scored"
    cmd = [sys.executable, "-m", "studies.recall", str(run), "--out", str(out),
           "--rows", "1", "--docs", "1", "--generate", "in_distribution"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

    with open(out / "r.csv") as f:
        rows = list(csv.DictReader(f))
    report = json.loads((out / "r.json").read_text())
    assert list(rows[0]) == [
        "seed", "document_mask", "reset_position_ids", "condition", "row", "query",
        "target_distance", "distance", "answer", "prediction", "correct", "generated",
    ]  # fmt: skip
    assert {r["document_mask"] for r in rows} == {r["reset_position_ids"] for r in rows} == {"True"}
    by = {c: [r for r in rows if r["condition"] == c] for c in report["summary"]}
    assert sorted(by) == ["anchor", "in_distribution", "interference", "length"]
    for condition, cell in report["summary"].items():
        mine = by[condition]
        assert cell["n"] == len(mine) > 0
        assert cell["accuracy"] == pytest.approx(sum(int(r["correct"]) for r in mine) / len(mine))
        assert all(int(r["correct"]) == (r["prediction"] == r["answer"]) for r in mine)
        # generated only where asked, and then equal to the teacher-forced prediction
        generated = [r["generated"] for r in mine]
        if condition == "in_distribution":
            assert generated == [r["prediction"] for r in mine]
        else:
            assert set(generated) == {""}
    distances = length_distances(MqarSpec(), 256)  # the experiment's corpus: the default spec
    assert report["max_doc_len"] == MqarSpec().max_doc_len and report["seq_len"] == 256
    assert list(report["summary"]["length"]["by_distance"]) == [str(d) for d in distances]
    for r in by["length"]:
        assert int(r["distance"]) >= int(r["target_distance"])
    assert len(by["anchor"]) == 16  # Zoology's (256, 16): one document of 16 queries


@pytest.mark.slow
def test_the_ablation_is_two_multiruns_and_stage_2_finds_its_stage_1(tmp_path):
    """python train.py -m experiment=recall_ablation_stage1, then -m experiment=recall_ablation
    with the same overrides (one arm and seed here): stage 2 starts from the stage-1 job of its
    own overrides; with another seed there is none, and it says so in one line."""
    tiny = ["seed=0", "data.document_mask=true", "data.reset_position_ids=false",
            "data.seq_len=256", "data.val_rows=1", "trainer.max_steps=2",
            "trainer.val_check_interval=2", "logger=csv", f"paths.cache_dir={tmp_path / 'cache'}",
            "data.shards=[{mqar:{documents:400,seed:0,val_documents:20}}]"]  # fmt: skip
    run_train(["-m", "experiment=recall_ablation_stage1", *tiny], tmp_path)
    (stage1,) = (tmp_path / "multirun" / "recall_stage1").glob("*/checkpoints/last.ckpt")
    run_train(["-m", "experiment=recall_ablation", *tiny], tmp_path)
    (stage2,) = (tmp_path / "multirun" / "train").rglob("checkpoints/last.ckpt")
    assert stage2.parent.parent.name == stage1.parent.parent.name  # the same overrides

    other = [a.replace("seed=0", "seed=1") for a in tiny]
    proc = run_train(["-m", "experiment=recall_ablation", *other], tmp_path, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"model.init_from='{tmp_path / 'multirun' / 'recall_stage1'}/" in said
    assert "seed=1" in said and "does not exist" in said
