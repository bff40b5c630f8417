"""overwrite=true deletes only its own run, a start takes back only what it added, and a run
stopped in training keeps what it logged (longctx.runs.folder; docs/reliability.md, "What
overwrite may delete"). The run-name checks go through train.py: Hydra resolves the run folder
(and would make it) before longctx's code runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import FAST, compose, read_metrics, run_train

from longctx.runs.folder import (
    RUN_MARKER,
    FolderState,
    marker_text,
    marker_verifies,
    named_run,
    newest_resumable_run,
)
from longctx.train.app import run
from longctx.train.nonfinite import NonFiniteStep

SHORT = [*FAST, "trainer.max_steps=1", "trainer.limit_val_batches=0"]


def tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` with what it is: a link's target, a file's bytes (links are
    not followed)."""
    found = {}
    for entry in sorted(FolderState.of(root).entries):
        path = root / entry
        if path.is_symlink():
            found[entry] = ("link", os.readlink(path))
        elif path.is_file():
            found[entry] = path.read_bytes()
        else:
            found[entry] = "folder"
    return found


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def a_run(folder: Path, marked: bool = True) -> Path:
    """A folder that looks like a finished run (a checkpoint, metrics), marked as longctx's."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    (folder / "csv").mkdir()
    (folder / "csv" / "metrics.csv").write_text("step,train/loss\n1,2.0\n")
    if marked:
        (folder / RUN_MARKER).write_text(marker_text(folder))
    return folder


# ------------------------------------------------------------------------------ run_name
@pytest.mark.parametrize("name", ["..", ".", "a/b", "/abs/path", ".hidden", "", "x" * 256])
def test_a_run_name_is_one_plain_folder_name(name, tmp_path):
    with pytest.raises(ValueError, match=r"run_name=.*a run name is one folder name"):
        named_run(tmp_path, name)
    assert named_run(tmp_path, "arm_a") == tmp_path / "arm_a"


@pytest.mark.parametrize("name", ["..", "ABSOLUTE", "a/b"])
def test_overwrite_with_a_run_name_outside_the_runs_folder_is_refused_and_deletes_nothing(
    name, tmp_path
):
    """run_name=.. once deleted a sibling run and the files in outputs/."""
    outputs = tmp_path / "outputs"
    a_run(outputs / "train" / "sibling")
    (outputs / "notes.txt").write_text("mine")
    elsewhere = a_run(tmp_path / "elsewhere")
    before = tree(tmp_path)
    name = str(elsewhere) if name == "ABSOLUTE" else name
    proc = run_train([*SHORT, f"run_name={name}", "overwrite=true"], tmp_path, check=False)
    assert one_error_line(proc).startswith(f"error: run_name={name!r}: a run name is one folder")
    assert tree(tmp_path) == before


def test_a_linked_run_folder_is_refused_and_its_target_untouched(tmp_path):
    target = a_run(tmp_path / "target")  # marked, even: the link is what is refused
    runs = tmp_path / "outputs" / "train"
    runs.mkdir(parents=True)
    (runs / "linked").symlink_to(target)
    before = tree(tmp_path)
    proc = run_train([*SHORT, "run_name=linked", "overwrite=true"], tmp_path, check=False)
    assert "is a symbolic link" in one_error_line(proc)
    assert tree(tmp_path) == before


def test_overwrite_refuses_a_folder_without_the_run_marker_and_leaves_it_whole(tmp_path):
    run_dir = a_run(tmp_path / "run", marked=False)
    (run_dir / "notes.txt").write_text("mine")
    before = tree(run_dir)
    with pytest.raises(
        ValueError, match=rf"overwrite=true: .* is not marked as a longctx run \(no {RUN_MARKER}"
    ):
        run(compose([*SHORT, "overwrite=true"], output_dir=run_dir))
    assert tree(run_dir) == before


def test_overwrite_unlinks_links_inside_the_run_never_their_targets_and_removes_it_whole(tmp_path):
    """A link to a folder inside a run once had overwrite delete half the run, then raise."""
    run_dir = tmp_path / "run"
    run(compose(SHORT, output_dir=run_dir))
    assert (run_dir / RUN_MARKER).is_file()
    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "inner" / "data.txt").write_text("keep")
    (run_dir / "a_link").symlink_to(outside)  # sorts before the run's own folders
    (run_dir / "csv" / "file_link").symlink_to(outside / "inner" / "data.txt")
    (run_dir / "old.txt").write_text("the previous run's")
    kept = tree(outside)
    run(compose([*SHORT, "overwrite=true"], output_dir=run_dir))
    assert tree(outside) == kept
    assert not os.path.lexists(run_dir / "a_link") and not (run_dir / "old.txt").exists()
    assert not os.path.lexists(run_dir / "csv" / "file_link")
    assert (run_dir / RUN_MARKER).is_file() and (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert [r["step"] for r in read_metrics(run_dir) if r.get("train/loss")] == ["1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "run"]  # nothing aside


@pytest.mark.parametrize("how", ["copied", "linked", "not longctx's"])
def test_overwrite_refuses_a_marker_not_made_in_the_folder(how, tmp_path):
    """A run folder copied elsewhere (its marker with it) once had overwrite=true delete the
    copy's contents: the marker names the folder it was made in."""
    made = a_run(tmp_path / "made")
    run_dir = tmp_path / "copy"
    shutil.copytree(made, run_dir)
    if how == "linked":
        (run_dir / RUN_MARKER).unlink()
        (run_dir / RUN_MARKER).symlink_to(made / RUN_MARKER)
    elif how == "not longctx's":
        (run_dir / RUN_MARKER).write_text("[" * 100_000)
    (run_dir / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with pytest.raises(
        ValueError, match=rf"overwrite=true: .*copy has a {RUN_MARKER} that was not"
    ):
        run(compose([*SHORT, "overwrite=true"], output_dir=run_dir))
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "held",
    ["", "a longctx run folder\n", "[1]", '{"longctx_run_folder": ["x"]}', "\udcff", "FOLDER"],
)
def test_a_marker_verifies_only_when_it_names_its_own_folder(held, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_MARKER).write_text(marker_text(run_dir))
    assert marker_verifies(run_dir)
    (run_dir / RUN_MARKER).unlink()
    if held == "FOLDER":
        (run_dir / RUN_MARKER).mkdir()
    else:
        (run_dir / RUN_MARKER).write_bytes(held.encode(errors="surrogateescape"))
    assert not marker_verifies(run_dir)


def test_overwrite_through_hydra_run_dir_outside_the_runs_folder_deletes_nothing(tmp_path):
    """The case measured: hydra.run.dir=DIR outside the runs folder, DIR holding a copied run
    and its marker. The refused start removes what Hydra wrote for it, nothing else."""
    made = a_run(tmp_path / "outputs" / "train" / "made")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(made, elsewhere)
    (elsewhere / "app.log").write_text("the user's log\n")
    before = tree(tmp_path)
    proc = run_train([*SHORT, f"hydra.run.dir={elsewhere}", "overwrite=true"], tmp_path,
                     check=False)  # fmt: skip
    assert "that was not made in this folder" in one_error_line(proc)
    assert tree(tmp_path) == before


def test_an_overwrite_refused_by_the_data_keeps_the_previous_run(tmp_path):
    """The data's vocabulary check comes after the run-folder checks: an overwrite once deleted
    the previous run before it, then the start was refused."""
    run_dir = a_run(tmp_path / "run")
    before = tree(run_dir)
    with pytest.raises(ValueError, match=r"model.vocab_size=16"):
        run(compose([*SHORT, "overwrite=true", "+model.vocab_size=16"], output_dir=run_dir))
    assert tree(run_dir) == before


def test_an_overwrite_remainder_and_a_linked_folder_are_never_resumed(tmp_path):
    a_run(tmp_path / "real")
    a_run(tmp_path / ".real.overwritten-0123abcd")  # a crash between rename and delete
    (tmp_path / "link").symlink_to(a_run(tmp_path.parent / f"{tmp_path.name}-elsewhere"))
    os.utime(tmp_path / "real" / "checkpoints" / "last.ckpt", (1, 1))  # the oldest
    assert newest_resumable_run(tmp_path) == tmp_path / "real"


# ------------------------------------------------------------------------ refused starts
def test_a_refused_start_removes_only_what_it_added(tmp_path):
    """A user's empty folder stays; a folder the start made goes, with Hydra's files in it."""
    runs = tmp_path / "outputs" / "train"
    (runs / "mine").mkdir(parents=True)
    for name in ("mine", "new"):
        proc = run_train([*SHORT, f"run_name={name}", "model.attn_backend=flash"], tmp_path,
                         check=False)  # fmt: skip
        assert "model.attn_backend=flash" in one_error_line(proc)
    assert (runs / "mine").is_dir() and not any((runs / "mine").iterdir())
    assert sorted(p.name for p in runs.iterdir()) == ["mine"]


def test_a_refused_resume_leaves_no_restart_config_lock_or_log_behind(tmp_path):
    run_train([*SHORT, "run_name=r"], tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "r"
    before = set(tree(run_dir))
    assert {".hydra/config.yaml", RUN_MARKER, "checkpoints/last.ckpt"} <= before
    resume = ["run_name=r", "ckpt_path=last", "trainer.max_steps=2", "optim.optimizer.lr=1e-3"]
    proc = run_train([*SHORT, *resume], tmp_path, check=False)
    assert "optim.optimizer.lr" in one_error_line(proc)
    assert set(tree(run_dir)) == before


# ------------------------------------------------------------------------ a stop in training
def test_a_nonfinite_stop_before_the_first_checkpoint_keeps_the_metrics_and_says_so(tmp_path):
    run_dir = tmp_path / "run"
    nan_at_step_3 = ["+callbacks.nan._target_=fault_injection.Fault",
                     "+callbacks.nan.kind=nan_loss", "+callbacks.nan.step=2"]  # fmt: skip
    with pytest.raises(NonFiniteStep) as stopped:
        run(compose([*SHORT, "trainer.max_steps=4", *nan_at_step_3], output_dir=run_dir))
    message = str(stopped.value)
    assert "step 3: loss nan" in message and "no checkpoint was written before it" in message
    assert f"{run_dir} keeps what it logged (csv)" in message, message
    assert "checkpoints keep" not in message
    assert [r["step"] for r in read_metrics(run_dir) if r.get("train/loss")] == ["1", "2"]
