"""Bad numbers and a first run through train.py (#29): a NaN step skipped then one that stops
the run with its checkpoint intact, and a clean run that is quiet, logs one row per optimizer
step (CSV and W&B) and ends with its folder. Two launches, several checks each.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import FAST, read_metrics, run_train, write_run_record

# ------------------------------------------------------------------ through train.py
# Lightning's messages that do not apply to a longctx run (longctx.train.console)
NOISE = (
    "srun",
    "litlogger",
    "anonymous",
    "Total FLOPs",
    "ModelCheckpoint with manual optimization",
    "Epoch 0/",
    "LeafSpec",
    "IterableDataset",
    "GPU available:",
    "TPU available:",
)


def steps_of(rows: list[dict], metric: str) -> list[int]:
    return [int(r["step"]) for r in rows if r.get(metric)]


def test_a_first_run_is_quiet_logs_optimizer_steps_and_ends_with_its_folder(tmp_path, monkeypatch):
    """Accumulation 2, validation every 2 steps, W&B offline and CSV, a progress bar, and an
    `srun` on PATH (Lightning's SLURM hint appears whenever there is one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = [
        *FAST, "logger=wandb", "trainer.enable_progress_bar=true",
        "data.seq_len=128", "optim.accumulate_grad_batches=2", "trainer.max_steps=4",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "callbacks.checkpoint.every_n_train_steps=2", "run_name=first",
    ]  # fmt: skip
    proc = run_train(args, tmp_path)
    said = proc.stdout + proc.stderr
    assert not [n for n in NOISE if n in said], said[-4000:]
    assert re.search(r"step\b.*\b4/4\b", proc.stdout), proc.stdout[-2000:]
    run_dir = tmp_path / "outputs" / "train" / "first"
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"run folder: {run_dir}", lines[-4:]
    assert f"checkpoint: {run_dir / 'checkpoints' / 'last.ckpt'} (step 4" in proc.stdout
    assert f"curves: wandb sync {run_dir / 'wandb'}/offline-run-*" in proc.stdout
    assert f"curves: {run_dir / 'csv' / 'metrics.csv'}" in proc.stdout
    # one row per optimizer step, at the step checkpoints and eval files use
    rows = read_metrics(run_dir)
    assert steps_of(rows, "train/loss") == [1, 2, 3, 4]
    assert steps_of(rows, "val/loss") == [2, 4]
    # W&B gets the same rows: Lightning hands every logger the same metrics at the same step
    assert any(run_dir.glob("wandb/offline-run-*/*.wandb"))


def test_a_nan_step_is_skipped_then_a_second_stops_the_run_keeping_the_checkpoint(tmp_path):
    """optim.skip_nonfinite=1: step 2's NaN is skipped, step 4's stops the run; the checkpoint
    of step 2 stays the last one, finite."""
    # tests/scripts/fault_injection.py, on the PYTHONPATH train.py inherits (tests/conftest.py)
    faults = [
        f"+callbacks.{name}.{key}={value}"
        for name, step in (("nan_a", 1), ("nan_b", 3))
        for key, value in (("_target_", "fault_injection.Fault"), ("kind", "nan_loss"),
                           ("step", step))
    ]  # fmt: skip
    args = [
        *FAST, "data.seq_len=128", "trainer.max_steps=6", "trainer.limit_val_batches=0",
        "optim.skip_nonfinite=1", "callbacks.checkpoint.every_n_train_steps=2",
        "callbacks.checkpoint.save_top_k=-1", "run_name=nonfinite", *faults,
    ]  # fmt: skip
    proc = run_train(args, tmp_path, check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-4000:]
    assert "step 2: loss nan, gradient norm nan: not finite, skipped without an update" in said
    assert re.search(r"error: step 4: loss nan.*after skipping 1 \(optim.skip_nonfinite=1\)", said)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    checkpoints = tmp_path / "outputs" / "train" / "nonfinite" / "checkpoints"
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)
    step2 = torch.load(next(checkpoints.glob("*step=2.ckpt")), weights_only=True)
    assert last["global_step"] == 2 and not list(checkpoints.glob("*step=4.ckpt"))
    for name, tensor in last["state_dict"].items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, step2["state_dict"][name])
    assert last["longctx"]["nonfinite_skipped"] == 1
    assert steps_of(read_metrics(checkpoints.parent), "train/loss") == [1, 2, 3]


# ------------------------------------------------------------------ config mistakes: one line
@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            ["optim.scheduler._target_=longctx.train.module.warmup_cosine"],
            "error: optim.scheduler._target_='longctx.train.module.warmup_cosine' cannot be "
            "imported",
        ),
        (
            ["+trainer.gradient_clip_val=1.0"],
            "error: trainer.gradient_clip_val=1.0: longctx's training step does this itself",
        ),
    ],
)
def test_a_config_mistake_in_a_resume_is_one_line_before_anything_runs(overrides, said, tmp_path):
    """Each was a traceback (tests/unit/test_hostile_inputs.py has the others, in process)."""
    last = write_run_record(tmp_path / "outputs" / "train" / "r", {}) / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    proc = run_train([*FAST, "run_name=r", "ckpt_path=last", *overrides], tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(said), proc.stderr[-2000:]
    assert last.read_bytes() == before  # the run's checkpoint is untouched
