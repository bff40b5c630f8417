"""studies.archive: a sweep's results kept without checkpoints, read by the reports
exactly as the run folders were; the archived record is data, refused as a checkpoint's is."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from helpers import write_run_record

from longctx.io import folder_mode
from longctx.runs.folder import LOCK_FILE, RUN_MARKER
from longctx.runs.record import RecordError
from studies import analysis, ruler_report
from studies.archive import archive_run, archive_runs
from studies.archive import main as archive_main
from studies.sweep_files import RECORD_FILE, find_runs, run_settings

DATA = {"seq_len": 128, "reset_position_ids": True, "document_mask": True}


def fake_run(root, arm: str, seed: int, shift: float):
    """A run as train.py and the suite leave it: checkpoints, lock, marker, metrics, results."""
    run = write_run_record(root / f"seed{seed}" / "outputs" / "train" / arm, DATA, arm, seed)
    (run / LOCK_FILE).write_text("pid")
    (run / RUN_MARKER).write_text("{}")
    (run / "checkpoints" / "epoch=0.ckpt").write_bytes(b"\0" * 4096)  # weights stay behind
    (run / "csv").mkdir()
    steps = np.arange(1, 201)
    pd.DataFrame({"step": steps, "train/loss": 3.0 / steps + shift}).to_csv(
        run / "csv" / "metrics.csv", index=False
    )
    scores = np.random.default_rng(seed).uniform(0, 1, 20) + shift
    rows = [{"step": 5, "seed": 0, "task": "lc_passkey", "length": 128, "depth": 0.5,
             "sample": s, "score": v, "correct_teacher_forced": v > 0.5}
            for s, v in enumerate(scores)]  # fmt: skip
    (run / "eval").mkdir()
    pd.DataFrame(rows).to_csv(run / "eval" / "ruler_results.csv", index=False)
    return run


@pytest.fixture
def sweep(tmp_path):
    root = tmp_path / "runs"
    for seed in (0, 1, 2):
        fake_run(root, "base", seed, 0.0)
        fake_run(root, "other", seed, -0.2)
    return root


def test_the_reports_read_an_archive_as_the_runs(sweep, tmp_path):
    dest = tmp_path / "archive"
    archived = archive_main([str(sweep), str(dest)])
    assert len(archived) == 6 and find_runs(dest) == sorted(archived)
    for run in archived:
        names = {p.relative_to(run).as_posix() for p in run.rglob("*")}
        assert names == {RECORD_FILE, "csv", "csv/metrics.csv.gz", "eval",
                         "eval/ruler_results.csv"}  # fmt: skip
        original = sweep / run.relative_to(dest)
        assert run_settings(run) == run_settings(original)
        assert (
            gzip.decompress((run / "csv" / "metrics.csv.gz").read_bytes())
            == (original / "csv" / "metrics.csv").read_bytes()
        )
    from_runs = ruler_report.summarize(sweep, "group", "base", n_boot=200)
    from_archive = ruler_report.summarize(dest, "group", "base", n_boot=200)
    assert from_archive["pairs"] == from_runs["pairs"] and from_archive["arms"] == from_runs["arms"]
    pd.testing.assert_frame_equal(analysis.load_local(dest), analysis.load_local(sweep))
    with pytest.raises(FileNotFoundError, match="holds only archived runs"):
        archive_runs(dest, tmp_path / "again")  # an archive is no run to archive


def test_archiving_again_replaces_only_an_archive(sweep, tmp_path):
    run = sweep / "seed0" / "outputs" / "train" / "base"
    dest = archive_run(run, tmp_path / "a" / "base")
    (run / "eval" / "later.csv").write_text("x\n1\n")
    archive_run(run, dest)  # the run went on: its new files replace the archive
    assert (dest / "eval" / "later.csv").is_file()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["base"]  # no staging left over
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not an archived run"):
        archive_run(run, mine)
    assert [p.name for p in mine.iterdir()] == ["notes"]


def test_a_run_without_a_record_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "runs" / "bare"
    (run / "checkpoints").mkdir(parents=True)
    import torch

    torch.save({"state_dict": {}}, run / "checkpoints" / "last.ckpt")
    with pytest.raises(RecordError, match="holds no run config"):
        archive_runs(tmp_path / "runs", tmp_path / "archive")
    assert not (tmp_path / "archive").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no run folders"):
        archive_runs(tmp_path / "empty", tmp_path / "x")


def test_the_command_refuses_a_missing_folder_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "studies.archive",
                           str(tmp_path / "missing"), str(tmp_path / "dest")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: no such folder: {tmp_path / 'missing'}"]
    assert not (tmp_path / "dest").exists()


def test_links_in_a_run_are_not_followed(sweep, tmp_path):
    run = sweep / "seed0" / "outputs" / "train" / "base"
    secret = tmp_path / "secret.txt"
    secret.write_text("not the run's")
    (run / "eval" / "linked.txt").symlink_to(secret)
    dest = archive_run(run, tmp_path / "archive" / "base")
    assert not (dest / "eval" / "linked.txt").exists()


def test_an_archived_record_is_data(sweep, tmp_path):
    """A record that names other code, or is not JSON, is refused in one line naming the file."""
    (dest,) = (archive_run(r, tmp_path / "a" / r.name) for r in find_runs(sweep)[:1])
    record = json.loads((dest / RECORD_FILE).read_text())
    record["config"]["model"]["_target_"] = "os.system"
    (dest / RECORD_FILE).write_text(json.dumps(record))
    with pytest.raises(RecordError, match=r"run_record\.json\.config\.model\._target_='os.system'"):
        run_settings(dest)
    (dest / RECORD_FILE).write_text("{not json")
    with pytest.raises(RecordError, match="not a readable run record"):
        run_settings(dest)
    (dest / RECORD_FILE).write_text(json.dumps({"identity": {}}))
    with pytest.raises(RecordError, match="holds no run config"):
        run_settings(dest)


def test_archive_removes_nothing_beside_dest_that_it_did_not_make(sweep, tmp_path):
    """It once deleted .DEST.old and .DEST.new beside DEST (a user's, or another archive's in
    progress) as "an interrupted archive's"."""
    run = sweep / "seed0" / "outputs" / "train" / "base"
    dest = tmp_path / "a" / "base"
    for name in (".base.old", ".base.new"):
        (dest.parent / name).mkdir(parents=True)
        (dest.parent / name / "keep.txt").write_text(name)
    archive_run(run, dest)
    archive_run(run, dest)  # replacing the archive: the earlier one is moved aside, removed
    assert sorted(p.name for p in dest.parent.iterdir()) == [".base.new", ".base.old", "base"]
    for name in (".base.old", ".base.new"):
        assert (dest.parent / name / "keep.txt").read_text() == name
    assert (dest / RECORD_FILE).is_file() and dest.stat().st_mode & 0o777 == folder_mode()


def test_a_link_at_dest_is_replaced_and_its_target_untouched(sweep, tmp_path):
    run = sweep / "seed0" / "outputs" / "train" / "base"
    elsewhere = archive_run(run, tmp_path / "elsewhere")  # an archive: DEST may replace it
    before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    dest = tmp_path / "a" / "base"
    dest.parent.mkdir()
    dest.symlink_to(elsewhere)
    archive_run(run, dest)
    assert not dest.is_symlink() and (dest / RECORD_FILE).is_file()
    assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before
