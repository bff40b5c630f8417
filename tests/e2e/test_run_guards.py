"""Guards around a run folder, fast (in-process where they can be): one writer, no fresh start over old
checkpoints, readable checkpoints (or a said fallback), the same arm on resume, the first
config and the metrics history kept, no empty folder after a refused start."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose, run_train
from hydra.utils import instantiate

from longctx.data import DataConfig
from longctx.model import LlamaConfig
from longctx.runs.checkpoints import UnreadableCheckpoint, resolve_ckpt_path
from longctx.runs.folder import RunFolderBusy, RunFolderLock, config_subdir, note_before_hydra
from longctx.runs.resume import ResumeMismatch, check_allowed_names, check_resume, run_identity
from longctx.train.app import ConfigError, run
from longctx.train.loggers import HistoryCSVLogger
from studies.analysis import csv_rows


def hydra_start(run_dir: Path) -> None:
    """What Hydra writes into a run folder before train.py's code runs, after the run-folder
    resolver noted what the folder held."""
    note_before_hydra(run_dir)
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text("x: 1\n")
    (run_dir / "train.log").write_text("")


def checkpoint_bytes(step: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"global_step": step, "state_dict": {"model.w": torch.ones(64)}}, buffer)
    return buffer.getvalue()


# ------------------------------------------------------------------------ data.shards
def test_data_shards_is_required_and_one_string_is_one_folder(tmp_path):
    with pytest.raises(ConfigError, match=r"data.shards is not set.*data.shards=DIR"):
        run(compose([*FAST, "data=shards"], output_dir=tmp_path / "run"))
    one = str(tmp_path / "one")
    cfg = compose([*FAST, "data=shards", f"data.shards={one}"], output_dir=tmp_path)
    assert list(instantiate(cfg.data).shards) == [one]
    assert DataConfig(shards=one).shards == [one]


# ------------------------------------------------------------------------- run folder
def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    lock = RunFolderLock(tmp_path).acquire()
    try:
        with pytest.raises(RunFolderBusy, match=rf"in use by pid {os.getpid()} on host"):
            run(compose(FAST, output_dir=tmp_path))
    finally:
        lock.release()
    RunFolderLock(tmp_path).acquire().release()  # free again once released


def test_a_fresh_start_among_old_checkpoints_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(checkpoint_bytes(3))
    with pytest.raises(ConfigError, match=r"already has checkpoints \(last.ckpt\).*overwrite=true"):
        run(compose(FAST, output_dir=tmp_path))
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_a_failed_preflight_leaves_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    hydra_start(run_dir)
    with pytest.raises(ConfigError, match="model.attn_backend=flash"):
        run(compose([*FAST, "model.attn_backend=flash"], output_dir=run_dir))
    assert not run_dir.exists()
    # a folder holding anything else is left alone
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    hydra_start(run_dir)
    with pytest.raises(ConfigError):
        run(compose([*FAST, "model.attn_backend=flash"], output_dir=run_dir))
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_later_starts_keep_the_first_config(tmp_path):
    assert config_subdir(str(tmp_path)) == ".hydra"
    hydra_start(tmp_path)
    assert config_subdir(str(tmp_path)) == ".hydra/restart-1"
    (tmp_path / ".hydra" / "restart-1").mkdir()
    assert config_subdir(str(tmp_path)) == ".hydra/restart-2"


def test_hydra_never_writes_its_config_through_a_link(tmp_path):
    """Hydra opens .hydra/config.yaml for writing: a dangling link there once made it create the
    file the link named; a linked .hydra had it write into the link's target."""
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").symlink_to(tmp_path / "outside.yaml")
    assert config_subdir(str(tmp_path)) == ".hydra/restart-1"
    (tmp_path / ".hydra" / "restart-1").symlink_to(tmp_path / "nowhere")
    assert config_subdir(str(tmp_path)) == ".hydra/restart-2"
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".hydra").symlink_to(tmp_path / ".hydra")
    with pytest.raises(ValueError, match=r"linked/\.hydra is a symbolic link"):
        config_subdir(str(linked))


# ------------------------------------------------------------------------ checkpoints
def test_an_unreadable_last_checkpoint_falls_back_and_says_so(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "epoch=0-step=4.ckpt").write_bytes(checkpoint_bytes(4))
    whole = checkpoint_bytes(6)
    for broken in (b"", whole[: len(whole) // 2]):  # zero bytes; truncated
        (checkpoints / "last.ckpt").write_bytes(broken)
        resume = resolve_ckpt_path("last", tmp_path)
        assert resume.path == str(checkpoints / "epoch=0-step=4.ckpt") and resume.step == 4
        assert re.search(r"last\.ckpt (is empty|cannot be read).*falling back", resume.note)
    (checkpoints / "epoch=0-step=4.ckpt").unlink()
    with pytest.raises(UnreadableCheckpoint, match=r"no readable checkpoint.*last\.ckpt"):
        resolve_ckpt_path("last", tmp_path)
    with pytest.raises(ConfigError, match=r"ckpt_path=.*last\.ckpt cannot be read"):
        run(compose([*FAST, f"ckpt_path={checkpoints / 'last.ckpt'}"], output_dir=tmp_path))


# --------------------------------------------------------------------- run identity
def identity(**changes) -> dict:
    model = {"rope_theta": 10000.0, **{k: v for k, v in changes.items() if k != "data"}}
    config = LlamaConfig.from_name("tiny", **model)
    return run_identity(config, DataConfig(**changes.get("data", {})))


def test_a_resume_that_changes_the_arm_is_refused_listing_the_changes():
    saved = {"longctx_run": {"identity": identity()}}
    changed = identity(rope_theta=5000.0, dim=128, data={"document_mask": False})
    with pytest.raises(ResumeMismatch) as refused:
        check_resume(saved, changed, [], "last.ckpt")
    message = str(refused.value)
    for line in ("model.rope_theta: 10000.0 (checkpoint) -> 5000.0 (now)", "model.dim: 256",
                 "data.document_mask: True (checkpoint) -> False (now)",
                 "allow_resume_changes=[data.document_mask,model.dim,model.rope_theta]"):  # fmt: skip
        assert line in message, message
    assert check_resume(saved, identity(attn_backend="eager"), [], "x") == {}  # how, not what
    allowed = ["model.rope_theta", "model.dim", "data.document_mask"]
    assert set(check_resume(saved, changed, allowed, "x")) == set(allowed)
    with pytest.raises(ResumeMismatch, match="model.rope_thta"):
        check_allowed_names(["model.rope_thta"], set(changed))


# ------------------------------------------------------------------- metrics history
def test_a_resumed_csv_log_keeps_its_history(tmp_path):
    first = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    for step in range(4):
        first.log_metrics({"train/loss": 10.0 + step}, step=step)
    first.save()
    second = HistoryCSVLogger(save_dir=str(tmp_path), name="csv", version="")  # a resume at 2
    for step in (2, 3, 4):
        second.log_metrics({"train/loss": 20.0 + step, "val/loss": 1.0}, step=step)
    second.save()
    rows = sorted(r for r in csv_rows(tmp_path / "csv" / "metrics.csv") if r[1] == "train/loss")
    assert rows == [(0, "train/loss", 10.0), (1, "train/loss", 11.0), (2, "train/loss", 22.0),
                    (3, "train/loss", 23.0), (4, "train/loss", 24.0)]  # fmt: skip


@pytest.mark.parametrize("value, shown", [("nan", "nan"), ("true", "True"), ("1e3", "1000.0")])
def test_a_run_name_the_command_line_reads_as_a_number_is_refused_in_one_line(
    tmp_path, value, shown
):
    proc = run_train([*FAST, f"run_name={value}", "dry_run=true"], tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: run_name={shown}; expected")
    assert not (tmp_path / "outputs").exists()


def test_a_numeric_run_name_is_the_folder_typed(tmp_path):
    from longctx.train.resolvers import run_dir

    assert run_dir(str(tmp_path), 123, None) == str(tmp_path / "123")
