"""The run folder's life: a refused start takes back what it wrote, whenever it is refused;
``overwrite=true`` starts a clean folder; the record that ships is the config that trained."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose, read_metrics, run_train

from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.folder import LOCK_FILE, last_checkpoint, note_before_hydra
from longctx.runs.record import read_stored_run
from longctx.train.app import run

SHORT = [*FAST, "trainer.max_steps=2", "trainer.val_check_interval=2"]


def hydra_start(run_dir: Path) -> None:
    """What Hydra writes into a run folder before train.py's code runs, after the run-folder
    resolver noted what the folder held."""
    note_before_hydra(run_dir)
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text("x: 1\n")


# refusals that only the data, the callbacks or Lightning can make, once training is set up
LATE_REFUSALS = {
    "upsampling above every document": (
        ["data.length_upsampling={min_tokens:100000000,factor:2}"],
        "min_tokens",
    ),
    "missing long documents": (
        ["callbacks=eval", "data.long_documents=/nonexistent/long"],
        "/nonexistent/long",
    ),
    "val split too small for a callback": (
        ["callbacks=ablation", "callbacks.held_out_documents.num_documents=100000"],
        "100000",
    ),
    "unknown trainer key": (["+trainer.no_such_key=1"], "no_such_key"),
}


@pytest.mark.parametrize("case", list(LATE_REFUSALS))
def test_a_late_refusal_leaves_no_run_folder(case, tmp_path):
    overrides, named = LATE_REFUSALS[case]
    run_dir = tmp_path / "run"
    hydra_start(run_dir)
    with pytest.raises((ValueError, FileNotFoundError), match=named):
        run(compose([*SHORT, *overrides], output_dir=run_dir))
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


def test_a_refused_resume_keeps_the_run_and_removes_what_the_start_added(tmp_path):
    run_dir = tmp_path / "run"
    run(compose([*SHORT, "data.num_streams=2"], output_dir=run_dir))
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    resume = ["data.num_streams=3", "ckpt_path=last", "trainer.max_steps=4"]
    with pytest.raises(ValueError, match="num_streams"):
        run(compose([*SHORT, *resume], output_dir=run_dir))
    after = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    assert after == before


def test_overwrite_starts_a_clean_folder_and_export_reads_the_new_config(tmp_path):
    common = [*SHORT, "run_name=r", "logger=wandb", "trainer.max_steps=3"]
    run_train([*common, "callbacks=eval"], tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "r"
    assert (run_dir / "eval").is_dir() and (run_dir / "wandb").is_dir()
    proc = run_train([*SHORT, "run_name=r", "overwrite=true", "model.rope_theta=10000"], tmp_path)
    assert "overwrite=true: deleted the previous run's" in proc.stdout
    assert not (run_dir / "eval").exists() and not (run_dir / "wandb").exists()
    assert not (run_dir / ".hydra" / "restart-1").exists()
    assert "rope_theta: 10000" in (run_dir / ".hydra" / "config.yaml").read_text()
    steps = [int(r["step"]) for r in read_metrics(run_dir) if r.get("train/loss")]
    assert steps == [1, 2]  # one row per optimizer step of the new run; none of the old's third
    stored = read_stored_run(run_dir, CONFIG_TARGETS).model_config()
    assert stored.rope_theta == 10000
    weights = torch.load(last_checkpoint(run_dir), weights_only=True)["state_dict"]
    assert weights  # the record sits beside the weights it describes


def test_a_dry_run_leaves_no_run_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    hydra_start(run_dir)
    report = run(compose(["dry_run=true", *SHORT], output_dir=run_dir))
    assert report["parameters"] > 0 and "capacity plan" in capsys.readouterr().out.lower()
    assert not run_dir.exists()


def test_a_finished_fit_gives_the_process_its_signal_handlers_back(tmp_path):
    """A sweep, a notebook or a test outlives the fit: a later fork (a data-prep pool) must
    not inherit the handler that turns SIGTERM into a checkpoint request."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    run(compose(SHORT, output_dir=tmp_path / "run"))
    assert {s: signal.getsignal(s) for s in before} == before


def files_in(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (links not followed): a file's bytes, a link's target."""
    return {
        p.relative_to(root).as_posix(): (
            f"link {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
        )
        for p in sorted(root.rglob("*"))
    }


def test_a_refused_start_in_a_users_folder_keeps_its_files_byte_identical(tmp_path):
    """hydra.run.dir=DIR: DIR's earlier contents were guessed, and a user's app.log was taken for
    Hydra's job log and deleted. What the folder held is noted before Hydra writes it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "app.log").write_bytes(b"the user's own log\n")
    (mine / "notes.txt").write_bytes(b"mine\n")
    before = files_in(tmp_path)
    for refusal in ("model.attn_backend=flash", "+callbacks.bad.foo=1"):
        proc = run_train([*SHORT, f"hydra.run.dir={mine}", refusal], tmp_path, check=False)
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert files_in(tmp_path) == before, proc.stderr[-2000:]
    new = tmp_path / "new" / "deeper"  # a folder (and parent) the start made: removed
    proc = run_train(
        [*SHORT, f"hydra.run.dir={new}", "+callbacks.bad.foo=1"], tmp_path, check=False
    )
    assert proc.returncode != 0 and files_in(tmp_path) == before, proc.stderr[-2000:]


def test_a_resume_refused_in_any_way_leaves_nothing_it_made(tmp_path):
    """A mistyped scheduler _target_ or +trainer.gradient_clip_val (errors other than the
    user-error classes) once left .hydra/restart-1 behind."""
    run_train([*SHORT, "run_name=r"], tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "r"
    before = files_in(run_dir)
    del before[LOCK_FILE]  # each start writes its holder line into the run's lock
    resume = ["run_name=r", "ckpt_path=last", "trainer.max_steps=4"]
    for refusal in ("optim.scheduler._target_=no.such.Scheduler", "+trainer.gradient_clip_val=1"):
        proc = run_train([*SHORT, *resume, refusal], tmp_path, check=False)
        assert proc.returncode != 0, proc.stdout[-2000:]
        after = {k: v for k, v in files_in(run_dir).items() if k != LOCK_FILE}
        assert after == before, proc.stderr[-2000:]
