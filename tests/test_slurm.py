"""A real single-host SLURM (scripts/slurm/local_cluster.sh): DDP through Hydra's submitit
launcher, an ablation sweep as a job array, preemption -> checkpoint -> requeue -> resume
identical to an uninterrupted run, and clear errors for jobs SLURM cannot run.

Skipped, with the reason, only where SLURM cannot start here (not root, no apt, node not idle).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import CACHE_DIR, ROOT, run_train

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
# tiny and quiet; OMP_NUM_THREADS=1 in ENV keeps SLURM jobs and local runs numerically alike
TINY = [
    "logger=csv",
    "data.seq_len=256",
    "data.micro_batch_size=2",
    "data.val_rows=4",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    f"paths.cache_dir={CACHE_DIR}",
]
ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def _cluster(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), cmd], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local cluster, started here if `make test` has not (and stopped again afterwards)."""
    if _cluster("status").returncode == 0:
        return
    if os.geteuid() != 0:
        pytest.skip(
            "SLURM is not running and starting it needs root (scripts/slurm/local_cluster.sh)"
        )
    started = _cluster("start")
    if started.returncode != 0:
        pytest.skip(f"SLURM could not start here: {started.stderr.strip()[-500:]}")
    atexit.register(_cluster, "stop")


@pytest.fixture
def one_thread(monkeypatch):
    """Local reference runs and SLURM jobs (sbatch exports the environment) alike."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# tests that need the cluster; the unit tests below them run anywhere
SLURM = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster", "one_thread")]


def on_slurm(test):
    for mark in SLURM:
        test = mark(test)
    return test


def job_info(job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for_job(job: str, timeout: float = 240, expedite_requeue: bool = False) -> dict:
    """Poll until the job ends. expedite_requeue: a requeued job is held ~60 s (BeginTime);
    start it at once instead of waiting (the test is about our requeue, not SLURM's delay)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job_info(job)
        state = info.get("JobState", "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return info
        if expedite_requeue and state == "PENDING" and info.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} did not finish in {timeout} s: {job_info(job)}")


def sbatch(args: list[str], cwd: Path, sbatch_flags: tuple[str, ...] = ()) -> str:
    env = {**ENV, "LONGCTX_PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    env["LONGCTX_TRAIN"] = str(ROOT / "train.py")
    proc = subprocess.run(
        ["sbatch", "--parsable", *sbatch_flags, str(SBATCH), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def submitit_logs(sweep_root: Path) -> str:
    return "".join(p.read_text() for p in sorted(sweep_root.rglob(".submitit/*/*_log.*")))


@on_slurm
def test_ddp_job_through_submitit_launcher(tmp_path):
    proc = run_train(
        ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug",
         "hydra.launcher.timeout_min=10", "trainer=ddp", "trainer.accelerator=cpu",
         "trainer.devices=2", "trainer.max_steps=3", "trainer.val_check_interval=3", *TINY],
        tmp_path,
        timeout=400,
    )  # fmt: skip
    logs = submitit_logs(tmp_path / "multirun")
    for rank in (0, 1):  # both SLURM tasks trained as ranks of one DDP group and exited cleanly
        assert f"longctx: rank {rank}/2 stopped at step 3" in logs, logs[-3000:]
    assert "SIGABRT" not in logs and "core dumped" not in logs, logs[-3000:]
    sbatch_file = next((tmp_path / "multirun").rglob(".submitit/*/*_submission.sh")).read_text()
    assert "--ntasks-per-node=2" in sbatch_file and "--signal=USR1@90" in sbatch_file
    job = next((tmp_path / "multirun").rglob(".submitit/*/*_submission.sh")).parent.name
    info = wait_for_job(job, timeout=120)  # submitit returns once rank 0 has its result
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", info
    assert list((tmp_path / "multirun").rglob("checkpoints/last.ckpt")), proc.stdout[-2000:]


@on_slurm
def test_ablation_sweep_is_a_job_array(tmp_path):
    run_train(
        ["-m", "experiment=position_ablation", "hydra/launcher=slurm",
         "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=10",
         "trainer.max_steps=2", "trainer.val_check_interval=2", *TINY],
        tmp_path,
        timeout=600,
    )  # fmt: skip
    job_dirs = sorted(p.name for p in (tmp_path / "multirun").rglob(".submitit/*_*") if p.is_dir())
    array_ids = {d.split("_")[0] for d in job_dirs}
    assert len(array_ids) == 1 and sorted(d.split("_")[1] for d in job_dirs) == list("0123"), (
        job_dirs
    )
    done = list((tmp_path / "multirun").rglob("checkpoints/last.ckpt"))
    assert len(done) == 4, done
    assert submitit_logs(tmp_path / "multirun").count("stopped at step 2") == 4


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


PREEMPT = [
    *TINY,
    "trainer.max_steps=30",
    "trainer.val_check_interval=30",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=5",
]


@on_slurm
def test_preempted_job_requeues_and_resumes_exactly(tmp_path):
    job = sbatch([f"paths.root_dir={tmp_path}", "run_name=preempted", *PREEMPT], tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "preempted"
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "last.ckpt").exists():  # training is under way
        assert time.time() < deadline, f"no checkpoint: {job_info(job)}"
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING"), job_info(job)
        time.sleep(0.5)
    # what SLURM sends before the time limit (--signal=USR1@90), to every task of the job
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    # meanwhile, the same run without interruption (outside SLURM, same settings)
    run_train(["run_name=uninterrupted", *PREEMPT], tmp_path, timeout=400)
    info = wait_for_job(job, timeout=400, expedite_requeue=True)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-3000:])
    assert "requeued SLURM job" in log and "resuming a preempted / requeued run" in log, log[-3000:]
    # SLURM kills the first run soon after `scontrol requeue`; its checkpoint was complete
    saved = [int(s) for s in re.findall(r"saved \S+ at step (\d+); stopping", log)]
    assert len(saved) == 1 and 5 <= saved[0] < 30, log[-3000:]
    assert "longctx: rank 0/1 stopped at step 30" in log
    assert not (run_dir / "checkpoints" / "PREEMPTED").exists()  # the finished run dropped it
    a, b = final_params(tmp_path / "outputs" / "train" / "uninterrupted"), final_params(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@on_slurm
@pytest.mark.parametrize(
    "override, message",
    [
        ("hydra.launcher.partition=no_such_partition", "partition=no_such_partition: no such"),
        ("trainer.num_nodes=3", "trainer.num_nodes=3 (hydra.launcher.nodes), but slurm partition"),
    ],
)
def test_unsatisfiable_submission_is_a_clear_error(override, message, tmp_path):
    proc = run_train(
        ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug", override,
         "trainer.max_steps=2", *TINY],
        tmp_path,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert message in (proc.stdout + proc.stderr).lower(), proc.stderr[-3000:]
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob("*.tmp"))


@on_slurm
def test_sbatch_too_many_nodes_is_refused_at_submission(tmp_path):
    proc = subprocess.run(
        ["sbatch", "--nodes=2", str(SBATCH), f"paths.root_dir={tmp_path}", *TINY],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 0:  # queued anyway: do not leave it pending
        subprocess.run(["scancel", proc.stdout.split()[-1]], timeout=30)
    # local_cluster.sh sets EnforcePartLimits=ALL: SLURM itself refuses, nothing is queued
    assert proc.returncode != 0 and "node count specification invalid" in proc.stderr.lower()
    assert not (tmp_path / "outputs").exists()


@on_slurm
def test_local_cluster_status_reports_the_node():
    out = _cluster("status")
    assert out.returncode == 0 and "debug" in out.stdout, out.stdout + out.stderr
    assert shutil.which("sinfo")


# ------------------------------------------------------------------ without a cluster
def test_auto_resume_only_after_preemption_or_restart(tmp_path, monkeypatch):
    from longctx.checkpoint import auto_resume_path

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    torch.save({"global_step": 3}, ckpts / "last.ckpt")
    assert auto_resume_path(tmp_path) is None  # a finished run is not resumed by accident
    (ckpts / "PREEMPTED").write_text("last.ckpt")
    assert auto_resume_path(tmp_path).path == str(ckpts / "last.ckpt")
    (ckpts / "PREEMPTED").unlink()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert auto_resume_path(tmp_path).path == str(ckpts / "last.ckpt")
    (ckpts / "last.ckpt").unlink()
    assert auto_resume_path(tmp_path) is None  # restarted before its first checkpoint: fresh


def test_run_folder_is_stable_inside_a_slurm_job(tmp_path, monkeypatch):
    from longctx.app import run_dir

    for var in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(var, raising=False)
    assert "slurm-" not in run_dir(str(tmp_path), "auto", None)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert run_dir(str(tmp_path), "auto", None) == str(tmp_path / "slurm-41")
    assert run_dir(str(tmp_path), "named", None) == str(tmp_path / "named")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert run_dir(str(tmp_path), "auto", None) == str(tmp_path / "slurm-40_3")


def test_lightning_auto_requeue_is_off_under_slurm(monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from longctx.distributed import slurm_plugins

    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    assert slurm_plugins() == []
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    (env,) = slurm_plugins()
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False


def test_requeue_outside_slurm_says_so(monkeypatch):
    from longctx.distributed import requeue_job

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="not inside a SLURM job"):
        requeue_job()


def test_save_on_signal_refuses_bad_settings():
    from longctx.callbacks import SaveOnSignal

    with pytest.raises(ValueError, match="SIGFOO"):
        SaveOnSignal(requeue_signals=["SIGFOO"])
    with pytest.raises(ValueError, match="requeue='yes'"):
        SaveOnSignal(requeue="yes")


def test_launcher_config_composes(tmp_path):
    """hydra/launcher=slurm: nodes and tasks follow the trainer; the signal is USR1."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from longctx.app import register_resolvers

    register_resolvers()
    overrides = ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=1", "trainer.devices=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("SlurmLauncher")
    cfg.hydra.runtime.output_dir = str(tmp_path)  # what Hydra fills in at run time
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node) == (1, 8)
    assert cfg.hydra.launcher.additional_parameters.signal == "USR1@90"


def test_unresolvable_master_address_is_a_clear_error(tmp_path, monkeypatch):
    from helpers import FAST

    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    proc = run_train([*FAST, "trainer.max_steps=2", "run_name=nomaster"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "MASTER_ADDR=no-such-host.invalid: the rendezvous host does not resolve" in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))
