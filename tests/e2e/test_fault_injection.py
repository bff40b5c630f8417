"""Every way a cluster stops a run, end to end through train.py on the tiny model.

Faults are injected from inside the run at an exact step (tests/fault_injection.py), so each
scenario is deterministic. Where the run is expected to resume, its final parameters must equal
those of one uninterrupted run (the ``reference`` fixture) bit for bit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import FAST, ROOT, SCRIPTS, read_metrics

pytestmark = pytest.mark.slow

# two data-loader workers (what data=shards runs with), checkpoints every 2 steps, 6 steps
STEPS = 6
BASE = [
    *FAST,
    "data.num_workers=2",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=3",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=2",
]


def fault(kind: str, step: int) -> list[str]:
    return [
        "+callbacks.fault._target_=fault_injection.Fault",
        f"+callbacks.fault.kind={kind}",
        f"+callbacks.fault.step={step}",
    ]


def train(root: Path, *args: str, wait: bool = True, multirun: bool = False):
    """train.py in its own process group (as a job step is), so a group signal stays inside."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]),
    }
    flags = ["-m"] if multirun else []  # Hydra takes its flags before the overrides
    cmd = [sys.executable, str(ROOT / "train.py"), *flags, *BASE, *args, f"paths.root_dir={root}"]
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def ok(proc) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def run_folder(root: Path, name: str) -> Path:
    return root / "outputs" / "train" / name


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_params(run: Path, reference: dict) -> None:
    final = load(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == STEPS
    params = final["state_dict"]
    assert params.keys() == reference.keys()
    different = [k for k in params if not torch.equal(params[k], reference[k])]
    assert not different, f"parameters differ from the uninterrupted run: {different}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root) -> dict:
    """The final parameters of one uninterrupted run."""
    ok(train(root, "run_name=reference"))
    return load(run_folder(root, "reference") / "checkpoints" / "last.ckpt")["state_dict"]


def test_kill_9_during_a_checkpoint_write(root, reference):
    killed = train(root, "run_name=kill_in_save", *fault("kill_in_save", 4))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = run_folder(root, "kill_in_save") / "checkpoints"
    partial = list(checkpoints.glob(".*.tmp"))
    assert partial, "the kill was meant to land mid-write, leaving a partial temp file"
    assert load(checkpoints / "last.ckpt")["global_step"] == 2  # the previous one, intact
    resumed = ok(train(root, "run_name=kill_in_save", "ckpt_path=last"))
    assert "at step 2" in resumed.stdout, resumed.stdout[-3000:]
    assert not any(p.exists() for p in partial), "a dead writer's temp file was left behind"
    assert_same_params(run_folder(root, "kill_in_save"), reference)


def test_preempt_with_workers_resume_crash_resume(root, reference):
    """SIGTERM to the process group (workers included) -> resume -> kill -9 between
    checkpoints -> resume: the last resume starts from the newest checkpoint, not the
    preemption's, and no second "last" appears."""
    run = run_folder(root, "chain")
    preempted = ok(train(root, "run_name=chain", *fault("sigterm_group", 1)))
    assert "saved" in preempted.stdout + preempted.stderr
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 2
    crashed = train(root, "run_name=chain", "ckpt_path=last", *fault("crash", 5))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("*.ckpt")) == ["last.ckpt"]
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    resumed = ok(train(root, "run_name=chain", "ckpt_path=last"))
    assert "at step 4" in resumed.stdout, resumed.stdout[-3000:]
    assert_same_params(run, reference)
    # the metrics history of all three attempts is kept
    steps = [int(r["step"]) for r in read_metrics(run) if r.get("train/loss")]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps  # optimizer steps done


def test_sigterm_during_validation_saves_and_says_so(root, reference):
    run = run_folder(root, "in_validation")
    stopped = train(root, "run_name=in_validation", *fault("sigterm_validation", 3))
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    said = stopped.stdout + stopped.stderr
    assert "fault_injection: sigterm_validation" in said
    saved = r"arrived during validation\): saved .*last\.ckpt at step 3"
    assert re.search(saved, said), said[-3000:]
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 3
    ok(train(root, "run_name=in_validation", "ckpt_path=last"))
    assert_same_params(run, reference)


# short arm folders: by default each is named by all of its overrides, too long for a file name
SWEEP_FOLDERS = ["hydra.sweep.dir=sweep", "hydra.sweep.subdir=arm${hydra.job.num}"]


def test_a_signal_ends_a_local_sweep_and_its_arm_resumes(root, reference):
    """SIGTERM in the first arm of a two-arm multirun (Hydra's basic launcher, one process):
    that arm saves and the sweep ends there, not going on to the second arm; the stopped arm
    resumes to the uninterrupted run's parameters where the message says."""
    stopped = ok(train(root, "seed=0,1", *SWEEP_FOLDERS, *fault("sigterm_group", 1), multirun=True))
    arm = root / "sweep" / "arm0"
    assert load(arm / "checkpoints" / "last.ckpt")["global_step"] == 2
    assert not (root / "sweep" / "arm1").exists(), "the sweep went on after the signal"
    said = re.search(
        r"the sweep ends here.*Resume this arm with its overrides and (.*)", stopped.stderr
    )
    assert said, stopped.stderr[-3000:]
    ok(train(root, "seed=0", *said.group(1).split()))
    assert_same_params(arm, reference)


# steps 0-2: 4 rows of 128 (stage 0); steps 3-5: 2 rows of 256 (data.seq_len, stage 1)
STAGES = "data.stages=[{until_step:3,seq_len:128,micro_batch_size:4}]"


def test_resume_across_a_stage_boundary_is_bitwise_exact(root):
    """Preempted right at the boundary (saved at step 3, the next step is the first of stage
    1), then killed just after it (last checkpoint at step 4), the staged run ends with the
    parameters of an uninterrupted one; train/stage and train/seq_len follow the stages."""
    ok(train(root, "run_name=staged_reference", STAGES))
    reference_run = run_folder(root, "staged_reference")
    steps = [r for r in read_metrics(reference_run) if r.get("train/loss")]
    logged = [(float(r["train/stage"]), float(r["train/seq_len"])) for r in steps]
    assert logged == [(0.0, 128.0)] * 3 + [(1.0, 256.0)] * 3
    run = run_folder(root, "staged")
    ok(train(root, "run_name=staged", STAGES, *fault("sigterm_group", 2)))
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 3
    crashed = train(root, "run_name=staged", "ckpt_path=last", STAGES, *fault("crash", 5))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == 4
    ok(train(root, "run_name=staged", "ckpt_path=last", STAGES))
    reference = load(reference_run / "checkpoints" / "last.ckpt")["state_dict"]
    assert_same_params(run, reference)


def test_resume_with_a_changed_arm_is_refused_unless_allowed(root, reference):
    shutil.copytree(run_folder(root, "reference"), run_folder(root, "arm"))
    run = run_folder(root, "arm")
    config_before = (run / ".hydra" / "config.yaml").read_text()
    metrics_before = read_metrics(run)
    changed = ["data.reset_position_ids=false", "++model.rope_theta=5000"]
    more = f"trainer.max_steps={STEPS + 1}"
    refused = train(root, "run_name=arm", "ckpt_path=last", more, *changed)
    assert refused.returncode == 2, refused.stderr[-3000:]
    for name in ("data.reset_position_ids", "model.rope_theta"):
        assert name in refused.stderr, refused.stderr[-3000:]
    assert "allow_resume_changes" in refused.stderr
    assert (run / ".hydra" / "config.yaml").read_text() == config_before
    assert read_metrics(run) == metrics_before
    allow = "allow_resume_changes=[data.reset_position_ids,model.rope_theta]"
    allowed = ok(train(root, "run_name=arm", "ckpt_path=last", more, *changed, allow))
    assert "allowed by allow_resume_changes: model.rope_theta" in allowed.stdout
    assert load(run / "checkpoints" / "last.ckpt")["global_step"] == STEPS + 1
    assert (run / ".hydra" / "config.yaml").read_text() == config_before


def test_a_second_writer_is_refused_and_named(root):
    # far more steps than the test lasts: the first run holds the folder until it is killed (with
    # STEPS it could finish, release the lock and let the second resume, on a fast machine)
    first = train(root, "run_name=shared", "trainer.max_steps=100000", wait=False)
    try:
        lock = run_folder(root, "shared") / ".lock"
        deadline = time.time() + 300
        while first.poll() is None and time.time() < deadline:
            if lock.exists() and "pid" in lock.read_text():
                break
            time.sleep(0.1)
        assert first.poll() is None, first.communicate()[1][-3000:]
        second = train(root, "run_name=shared", "ckpt_path=last")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"in use by pid {first.pid} on host" in second.stderr, second.stderr[-3000:]
        assert first.poll() is None  # the first run is untouched
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=60)
