"""The committed evidence rerun recomputes: each report command of scripts/evidence.sh, run on
the committed run archive (docs/results/evidence/rerun/runs, no checkpoints) and the committed
readings in the training formats (rerun/ood_position), writes the committed report JSON and the
per-instance and per-seed tables beside it. The commands are the script's, with the note each
committed JSON recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from helpers import same

from studies import analysis, extension_report, ood_report, ruler_report

REPO = Path(__file__).resolve().parents[2]
RERUN = Path("docs/results/evidence/rerun")  # relative: the reports record the root they read
RUNS = RERUN / "runs"


def note(name: str) -> str:
    return json.loads((REPO / RERUN / name).read_text())["note"]


# report: (the archive part it reads, the command that writes it into OUT)
REPORTS = {
    "control.json": ("control", lambda out: ruler_report.main([
        str(RUNS / "control"), "--arm-by", "group", "--control", "ruler_control",
        "--json", str(out / "control.json"), "--note", note("control.json")])),
    "position.json": ("position", lambda out: analysis.main([
        str(RUNS / "position"), "--out", str(out / "position.png")])),
    "position_ruler.json": ("position", lambda out: ruler_report.main([
        str(RUNS / "position"), "--arm-by", "position", "--json", str(out / "position_ruler.json"),
        "--note", note("position_ruler.json")])),
    "ood_position.json": ("position", lambda out: ood_report.main([
        str(RERUN / "ood_position"), "--json", str(out / "ood_position.json"),
        "--note", note("ood_position.json")])),
    "extension.json": ("extension", lambda out: extension_report.main([
        str(RUNS / "extension"), "--json", str(out / "extension.json"),
        "--out", str(out / "extension.png"), "--note", note("extension.json")])),
    "extension_ruler.json": ("extension", lambda out: ruler_report.main([
        str(RUNS / "extension"), "--arm-by", "rope_arm", "--control", "unchanged",
        "--json", str(out / "extension_ruler.json"), "--note", note("extension_ruler.json")])),
}  # fmt: skip
COMMITTED = sorted(name for name in REPORTS if (REPO / RERUN / name).is_file())


def tables(folder: Path) -> list[str]:
    """The report files a comparison covers: JSON and tables, not figures."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".json", ".csv", ".csv.gz")))


def test_every_archived_part_has_its_reports():
    parts = {p.name for p in (REPO / RUNS).iterdir() if p.is_dir()}
    assert parts, f"nothing archived under {REPO / RUNS}"
    assert {part for part, _ in REPORTS.values()} >= parts
    for name, (part, _) in REPORTS.items():
        assert (name in COMMITTED) == (part in parts), f"{name}: part {part} archived?"


def test_the_archive_holds_no_checkpoint_and_every_timed_run():
    assert not [p for p in (REPO / RUNS).rglob("*") if p.suffix in {".ckpt", ".pt", ".distcp"}]
    timing = pd.read_csv(REPO / RUNS / "timing.csv")
    assert (timing["status"] == "ok").all(), timing[timing["status"] != "ok"]
    for row in timing.itertuples():
        seed = REPO / RUNS / row.part / f"seed{row.seed}"
        assert list(seed.rglob(f"{row.run}/run_record.json")), f"{row.run} of {seed} not archived"


@pytest.mark.parametrize("name", COMMITTED)
def test_the_committed_report_is_what_the_archive_gives(tmp_path, monkeypatch, name):
    monkeypatch.chdir(REPO)
    REPORTS[name][1](tmp_path)
    written = tables(tmp_path)
    assert name in written
    for file in written:
        mine, committed = tmp_path / file, REPO / RERUN / file
        if file.endswith(".json"):
            same(json.loads(mine.read_text()), json.loads(committed.read_text()), file)
        else:
            pd.testing.assert_frame_equal(pd.read_csv(mine), pd.read_csv(committed), rtol=1e-9)
