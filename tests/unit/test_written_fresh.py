"""Every file longctx writes into a folder is created fresh (a temp file renamed over it): a
symbolic link or a second hard link placed where it writes, in a run folder or an output folder
someone handed over, is replaced, never written through; a file appended in place (the metrics
log, the run folder's lock) is refused by name when it is not a plain file of its own
(docs/reliability.md, "A handed-over folder is read, never executed or written through")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from longctx.eval.files import append_rows, write_json, write_rows
from longctx.io import NotAPlainFile, atomic_append_bytes, atomic_write_bytes
from longctx.probe.report import Report
from longctx.runs.folder import LOCK_FILE, RunFolderLock, RunFolderRefused
from longctx.train.loggers import HistoryCSVLogger, persistent_run_id

OUTSIDE = b"the user's file, outside the folder\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_bytes(OUTSIDE)
    return path


def planted(folder: Path, name: str, target: Path, how: str) -> Path:
    """``folder/name`` made a symbolic link, or a hard link, to ``target``."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target) if how == "symlink" else os.link(target, path)
    return path


def assert_replaced(path: Path, outside: Path) -> None:
    assert outside.read_bytes() == OUTSIDE
    assert not path.is_symlink() and os.stat(path).st_nlink == 1


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_an_atomic_write_replaces_a_link_and_never_writes_its_target(tmp_path, outside, how):
    path = planted(tmp_path / "run", "x.json", outside, how)
    atomic_write_bytes(path, b"ours")
    assert_replaced(path, outside)
    assert path.read_bytes() == b"ours"


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_an_append_writes_a_fresh_file(tmp_path, outside, how):
    """A link's target is not read either: its bytes are not the run's to copy."""
    path = planted(tmp_path / "run", "x.csv", outside, how)
    atomic_append_bytes(path, b"1\n", head=b"a\n")
    assert_replaced(path, outside)
    assert path.read_bytes() == (b"a\n1\n" if how == "symlink" else OUTSIDE + b"1\n")


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_eval_outputs_are_written_fresh(tmp_path, outside, how):
    """eval once wrote through RUN/eval/ruler/ruler.json, and appended through its tables."""
    out = tmp_path / "run" / "eval" / "ruler"
    for name in ("ruler.json", "ruler_results.csv", "position_loss.csv", "report.json"):
        planted(out, name, outside, how)
    write_json({"score": 1.0}, out / "ruler.json")
    write_rows([{"step": 1, "score": 0.5}], out / "ruler_results.csv")
    append_rows([{"step": 1, "loss": 2.0}], out / "position_loss.csv")
    append_rows([{"step": 2, "loss": 1.5}], out / "position_loss.csv")
    Report(results=[], context={}).write_json(out / "report.json")
    for name in ("ruler.json", "ruler_results.csv", "position_loss.csv", "report.json"):
        assert_replaced(out / name, outside)
    assert (out / "ruler_results.csv").read_text() == "step,score\n1,0.5\n"
    tail = "step,loss\n1,2.0\n2,1.5\n"
    expected = tail if how == "symlink" else OUTSIDE.decode() + tail.split("\n", 1)[1]
    assert (out / "position_loss.csv").read_text() == expected


def test_a_ruler_instances_file_is_written_fresh(tmp_path, outside):
    from longctx.eval.ruler import write_instances

    path = planted(tmp_path / "run" / "eval" / "ruler", "ruler_instances.jsonl", outside, "symlink")
    write_instances([], None, path)
    assert_replaced(path, outside)


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_a_resume_refuses_a_metrics_log_that_is_not_its_own_file(tmp_path, outside, how):
    """A resume once appended its rows through csv/metrics.csv. It appends in place (a run logs
    every step), so a link there is refused by name: replacing it would lose the history."""
    planted(tmp_path / "csv", "metrics.csv", outside, how)
    logger = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    with pytest.raises(NotAPlainFile, match=r"the metrics log .*metrics\.csv is a (symbolic|file)"):
        logger.log_metrics({"train/loss": 1.0}, step=1)
    assert outside.read_bytes() == OUTSIDE


def test_hparams_and_the_wandb_id_are_written_fresh(tmp_path, outside):
    planted(tmp_path / "csv", "hparams.yaml", outside, "symlink")
    logger = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    logger.log_hyperparams({"lr": 0.1})
    assert_replaced(tmp_path / "csv" / "hparams.yaml", outside)
    assert (tmp_path / "csv" / "hparams.yaml").read_text() == "lr: 0.1\n"
    dangling = tmp_path / "nowhere" / "id"
    dangling.parent.mkdir()
    planted(tmp_path, "wandb_run_id", dangling, "symlink")  # a link to a file not there yet
    run_id = persistent_run_id(tmp_path)
    assert not dangling.exists() and (tmp_path / "wandb_run_id").read_text() == run_id


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_the_run_folders_lock_is_never_written_through(tmp_path, outside, how):
    """The lock is opened in place (every process must lock one file) and truncated to name its
    holder: through a link it once emptied the file it pointed to."""
    planted(tmp_path, LOCK_FILE, outside, how)
    with pytest.raises(RunFolderRefused, match=rf"lock .*{LOCK_FILE} is a"):
        RunFolderLock(tmp_path).acquire()
    assert outside.read_bytes() == OUTSIDE


def _start_rank(folder: str, barrier, ids) -> None:
    barrier.wait()  # every rank of a job builds its loggers at once
    ids.put(persistent_run_id(Path(folder)))


def test_ranks_starting_together_share_one_wandb_id(tmp_path):
    """Each rank of a SLURM job asks for the run's W&B id as it starts: when each wrote its own,
    rank 0 logged under an id the folder did not keep, and the requeued job started a second
    W&B run (tests/e2e/test_slurm.py saw two offline runs)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    for attempt in range(5):
        folder = tmp_path / f"run{attempt}"
        barrier, ids = ctx.Barrier(4), ctx.Queue()
        ranks = [
            ctx.Process(target=_start_rank, args=(str(folder), barrier, ids)) for _ in range(4)
        ]
        for rank in ranks:
            rank.start()
        for rank in ranks:
            rank.join(timeout=60)
        seen = {ids.get(timeout=5) for _ in ranks}
        assert seen == {(folder / "wandb_run_id").read_text()}, seen
        assert [p.name for p in folder.iterdir()] == ["wandb_run_id"]  # no temp files left
