"""The committed recall evidence recomputes: the report command, run on the committed per-run
scores of each result folder under docs/results/recall, writes its committed recall.json and
per-seed CSV."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from helpers import same

from studies.recall_report import main

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "recall"
FOLDERS = sorted({p.parent for p in RESULTS.rglob("scores/*.csv")})


def test_recall_results_are_committed():
    assert FOLDERS, f"no committed recall scores under {RESULTS}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.parent.name)
def test_the_committed_report_is_what_its_committed_scores_give(tmp_path, folder):
    evidence = folder.parent
    swapped = evidence / "swapped"  # the masked runs read under the other position ids
    main([str(folder), "--out", str(tmp_path), *(["--swapped", str(swapped)] * swapped.is_dir())])
    same(
        json.loads((tmp_path / "recall.json").read_text()),
        json.loads((evidence / "recall.json").read_text()),
    )
    pd.testing.assert_frame_equal(
        pd.read_csv(tmp_path / "recall_seeds.csv"), pd.read_csv(evidence / "recall_seeds.csv")
    )
