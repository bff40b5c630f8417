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
