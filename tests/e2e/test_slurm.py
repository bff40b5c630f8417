"""A real SLURM of two nodes on one host (scripts/slurm/local_cluster.sh: n1 and n2, one CPU
each): DDP, FSDP2 and a context-parallel group across the two nodes, each equal to one process;
the ablation sweep as a job array spread over both nodes; a preempted two-node job that requeues
and resumes exactly (same W&B run, same data position); clear errors for jobs SLURM cannot run
and for multi-node mistakes (node count, MASTER_ADDR). Every job goes through a real launch path:
Hydra's submitit launcher or scripts/slurm/train.sbatch.

Skipped, with the reason, only where SLURM cannot start here (not root, no apt, nodes not idle).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import CACHE_DIR, ROOT, read_metrics, run_train
from slurm_cluster import cluster, nodes, slurm_cluster  # noqa: F401 (the fixture)

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


def sbatch(
    args: list[str], cwd: Path, sbatch_flags: tuple[str, ...] = (), env: dict | None = None
) -> str:
    env = {**ENV, **(env or {}), "LONGCTX_PYTHON": sys.executable}
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


# ------------------------------------------------------- two nodes, each equal to one process
# 3 AdamW steps over two data streams. Two data-parallel ranks (DDP, FSDP2) see in a step the
# two micro-batches one process accumulates (the global row order does not depend on the number
# of ranks); a context-parallel pair reads one process's batches. So every two-node run below
# is compared to the same one-process run.
STEPS = [*TINY, "trainer.max_steps=3", "trainer.deterministic=true", "data.num_streams=2"]
ONE_PROCESS = [
    "optim.accumulate_grad_batches=2",
    "trainer.val_check_interval=3",  # optimizer steps: after step 3
    "trainer.limit_val_batches=2",  # the 4 validation rows the two ranks share out
]
TWO_NODES = ["trainer.accelerator=cpu", "trainer.num_nodes=2", "trainer.devices=1"]
DATA_PARALLEL = [*TWO_NODES, "trainer.val_check_interval=3"]
# one sweep point: a folder named by its number (the overrides would exceed 255 bytes)
LAUNCHER = ["-m", "hydra/launcher=slurm", "hydra.launcher.partition=debug",
            "hydra.launcher.timeout_min=10", "hydra.sweep.subdir=${hydra.job.num}"]  # fmt: skip


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("one_process")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # as the SLURM jobs run
        run_train([*STEPS, *ONE_PROCESS, "run_name=reference"], root, timeout=400)
    return root / "outputs" / "train" / "reference"


def step_losses(run_dir: Path) -> dict[float, float]:
    """{tokens seen: train loss} per optimizer step (under gradient accumulation the CSV
    logger repeats a step's row for each micro-batch)."""
    rows = [r for r in read_metrics(run_dir) if r.get("train/loss")]
    return {float(r["train/tokens_seen"]): float(r["train/loss"]) for r in rows}


def assert_trained_alike(run_dir: Path, reference: Path, params: bool = True) -> None:
    """Same train losses (every step), validation loss after the last step and, from a
    single-file checkpoint, parameters as the reference, to fp32 reduction-order noise."""
    got, expected = step_losses(run_dir), step_losses(reference)
    assert len(got) == 3 and list(got) == list(expected), (got, expected)
    assert list(got.values()) == pytest.approx(list(expected.values()), rel=1e-5)
    val = [[float(r["val/loss"]) for r in read_metrics(d) if r.get("val/loss")]
           for d in (run_dir, reference)]  # fmt: skip
    assert len(val[0]) == 1 and val[0] == pytest.approx(val[1], rel=1e-5), val
    if params:
        got, expected = final_params(run_dir), final_params(reference)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            # AdamW moves a weight by up to lr (6e-4 here) per step whatever its gradient's
            # size, so reduction-order noise in a near-zero gradient shows in the weight:
            # the bound is 2% of one step's update (as in test_context_parallel)
            torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-5, msg=name)


def ranks_by_node(logs: str, world: int) -> dict[int, str]:
    """{global rank: node} from the `longctx: rank r/world stopped at step ... on node n` lines."""
    found = re.findall(rf"longctx: rank (\d+)/{world} stopped at step \d+ on node (\S+)", logs)
    return {int(rank): node for rank, node in found}


def launcher_job(sweep_root: Path) -> str:
    return next(sweep_root.rglob(".submitit/*/*_submission.sh")).parent.name


@on_slurm
def test_two_node_ddp_through_submitit_equals_one_process(tmp_path, one_process_run):
    run_train([*LAUNCHER, "trainer=ddp", *DATA_PARALLEL, *STEPS], tmp_path, timeout=400)
    sweep = tmp_path / "multirun"
    logs = submitit_logs(sweep)
    assert ranks_by_node(logs, 2) == {0: "n1", 1: "n2"}, logs[-3000:]
    assert "SIGABRT" not in logs and "core dumped" not in logs, logs[-3000:]
    sbatch_file = next(sweep.rglob(".submitit/*/*_submission.sh")).read_text()
    assert "--nodes=2" in sbatch_file and "--ntasks-per-node=1" in sbatch_file
    assert "--signal=USR1@90" in sbatch_file and "SLURM_KILL_BAD_EXIT=1" in sbatch_file
    info = wait_for_job(launcher_job(sweep), timeout=120)  # submitit returns with rank 0
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", info
    assert info.get("NodeList") == "n[1-2]", info
    (run_dir,) = [p.parent.parent for p in sweep.rglob("checkpoints/last.ckpt")]
    assert_trained_alike(run_dir, one_process_run)


@on_slurm
def test_two_node_fsdp_through_sbatch_equals_one_process(tmp_path, one_process_run):
    flags = ("--nodes=2", "--ntasks-per-node=1")
    job = sbatch([f"paths.root_dir={tmp_path}", "run_name=fsdp", "trainer=fsdp",
                  "trainer.accelerator=cpu", "trainer.val_check_interval=3", *STEPS],
                 tmp_path, flags)  # fmt: skip
    info = wait_for_job(job, timeout=400)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", (info, log[-3000:])
    assert ranks_by_node(log, 2) == {0: "n1", 1: "n2"}, log[-3000:]
    run_dir = tmp_path / "outputs" / "train" / "fsdp"
    shards = sorted(p.name for p in (run_dir / "checkpoints" / "last.ckpt").iterdir())
    assert sum(name.endswith(".distcp") for name in shards) == 2, shards  # one per node
    # the sharded checkpoint is a folder: the validation loss after step 3 checks the weights
    assert_trained_alike(run_dir, one_process_run, params=False)


@on_slurm
def test_context_parallel_group_across_two_nodes_equals_one_process(tmp_path, one_process_run):
    """Both ranks split every row: the CP group is {0 on n1, 1 on n2}, no data parallelism."""
    cp = ["trainer=ddp", *TWO_NODES, "parallel.context_parallel=2", *ONE_PROCESS]
    run_train([*LAUNCHER, *STEPS, *cp], tmp_path, timeout=400)  # later overrides win
    sweep = tmp_path / "multirun"
    logs = submitit_logs(sweep)
    assert ranks_by_node(logs, 2) == {0: "n1", 1: "n2"}, logs[-3000:]
    wait_for_job(launcher_job(sweep), timeout=120)
    (run_dir,) = [p.parent.parent for p in sweep.rglob("checkpoints/last.ckpt")]
    assert_trained_alike(run_dir, one_process_run)


@on_slurm
def test_ablation_sweep_is_a_job_array(tmp_path, tiny_position_ablation):
    run_train(
        ["-m", *tiny_position_ablation, "hydra/launcher=slurm",
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
    logs = submitit_logs(tmp_path / "multirun")
    nodes = re.findall(r"rank 0/1 stopped at step 2 on node (\S+)", logs)
    # one CPU per node: the array's jobs ran side by side, on both nodes
    assert len(nodes) == 4 and set(nodes) == {"n1", "n2"}, nodes


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


PREEMPT = [
    *[arg for arg in TINY if not arg.startswith("logger=")],
    "trainer=ddp",
    "trainer.accelerator=cpu",  # train.sbatch: trainer.num_nodes=2 trainer.devices=1
    "trainer.max_steps=16",
    "trainer.val_check_interval=16",
    "trainer.deterministic=true",
    "callbacks.checkpoint.every_n_train_steps=4",
]


def data_state(run_dir: Path) -> dict:
    """The datamodule's saved position: global rows consumed and every stream's cursor."""
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    (state,) = [v for v in ckpt.values() if isinstance(v, dict) and "rows_consumed" in v]
    return {k: state[k] for k in ("rows_consumed", "streams")}


@on_slurm
@pytest.mark.slow
def test_preempted_two_node_job_requeues_and_resumes_exactly(tmp_path):
    """SIGUSR1 to both nodes mid-run: checkpoint, requeue, resume in the same W&B run and at
    the same data position; the result equals the same two ranks run without interruption."""
    wandb = ["logger=wandb", "+logger.csv={}"]  # W&B offline (no key): a local run folder
    job = sbatch([f"paths.root_dir={tmp_path}", "run_name=preempted", *PREEMPT, *wandb],
                 tmp_path, ("--nodes=2", "--ntasks-per-node=1"))  # fmt: skip
    run_dir = tmp_path / "outputs" / "train" / "preempted"
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "last.ckpt").exists():  # training is under way
        assert time.time() < deadline, f"no checkpoint: {job_info(job)}"
        assert job_info(job).get("JobState") in ("PENDING", "RUNNING"), job_info(job)
        time.sleep(0.5)
    # what SLURM sends before the time limit (--signal=USR1@90), to every task of the job
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    # meanwhile, the same two ranks without interruption (outside SLURM, on this host)
    local = ["run_name=uninterrupted", *PREEMPT, "trainer.devices=2", "logger=csv"]
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(run_train, local, tmp_path, timeout=400)
        info = wait_for_job(job, timeout=400, expedite_requeue=True)
        uninterrupted.result()
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-3000:])
    assert info["NodeList"] == "n[1-2]", info
    assert "requeued SLURM job" in log and "resuming a preempted / requeued run" in log, log[-3000:]
    # SLURM kills the first run soon after `scontrol requeue`; its checkpoint was complete
    saved = [int(s) for s in re.findall(r"saved \S+ at step (\d+); stopping", log)]
    assert len(saved) == 1 and 4 <= saved[0] < 16, log[-3000:]
    final = re.findall(r"longctx: rank (\d)/2 stopped at step 16 on node (n\d)", log)
    assert sorted(final) == [("0", "n1"), ("1", "n2")], log[-3000:]
    assert not (run_dir / "checkpoints" / "PREEMPTED").exists()  # the finished run dropped it
    # one W&B run: both starts logged offline under the id the run folder keeps
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    starts = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(starts) == 2 and all(name.endswith(f"-{run_id}") for name in starts), starts
    reference = tmp_path / "outputs" / "train" / "uninterrupted"
    assert data_state(run_dir) == data_state(reference)  # same batches consumed, same cursors
    a, b = final_params(reference), final_params(run_dir)
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
        ["sbatch", "--nodes=3", str(SBATCH), f"paths.root_dir={tmp_path}", *TINY],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 0:  # queued anyway: do not leave it pending
        subprocess.run(["scancel", proc.stdout.split()[-1]], timeout=30)
    # local_cluster.sh sets EnforcePartLimits=ALL: SLURM itself refuses, nothing is queued
    # (3 nodes of 2, or 3 CPUs of 2: which limit SLURM names first depends on its version)
    refused = re.search(
        "node count specification invalid|more processors requested", proc.stderr, re.I
    )
    assert proc.returncode != 0 and refused, proc.stderr
    assert not (tmp_path / "outputs").exists()


@on_slurm
@pytest.mark.parametrize(
    "args, env, message",
    [
        (["trainer.num_nodes=1"], {},
         "trainer.num_nodes=1, but this SLURM job runs on 2 node(s) (n[1-2])"),
        ([], {"MASTER_ADDR": "192.0.2.1"},  # TEST-NET-1: an address of no machine here
         "MASTER_ADDR=192.0.2.1 (192.0.2.1) is not an address of node n1, where global rank 0"),
    ],
)  # fmt: skip
def test_two_node_mistakes_fail_fast_naming_the_values(args, env, message, tmp_path):
    """Caught before training on every rank (or on rank 0, and srun ends the other)."""
    flags = ("--nodes=2", "--ntasks-per-node=1")
    job = sbatch([f"paths.root_dir={tmp_path}", *TINY, "trainer.accelerator=cpu", *args],
                 tmp_path, flags, env=env)  # fmt: skip
    info = wait_for_job(job, timeout=180)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and message in log, (info, log[-3000:])
    assert not list(tmp_path.rglob("*.ckpt"))


@on_slurm
def test_local_cluster_has_two_idle_nodes_and_start_is_idempotent():
    out = cluster("status")
    assert out.returncode == 0 and "debug" in out.stdout, out.stdout + out.stderr
    assert nodes() == ["n1", "n2"], out.stdout
    if os.geteuid() != 0:
        return  # start needs root
    pids = sorted(Path("/run/slurm").glob("*.pid"))
    before = {p.name: p.read_text() for p in pids}
    again = cluster("start")  # on a running cluster of the same layout: nothing restarts
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_text() for p in pids} == before
    assert {"slurmctld.pid", "slurmd-n1.pid", "slurmd-n2.pid"} <= set(before), before


# ------------------------------------------------------------------ without a cluster
def test_auto_resume_only_after_preemption_or_restart(tmp_path, monkeypatch):
    from longctx.runs.checkpoints import auto_resume_path

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
    from longctx.train.resolvers import run_dir

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

    from longctx.distributed.slurm import slurm_plugins

    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    assert slurm_plugins() == []
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    (env,) = slurm_plugins()
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False


def test_requeue_outside_slurm_says_so(monkeypatch):
    from longctx.distributed.slurm import requeue_job

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(RuntimeError, match="not inside a SLURM job"):
        requeue_job()


def test_save_on_signal_refuses_bad_settings():
    from longctx.train.callbacks import SaveOnSignal

    with pytest.raises(ValueError, match="SIGFOO"):
        SaveOnSignal(requeue_signals=["SIGFOO"])
    with pytest.raises(ValueError, match="requeue='yes'"):
        SaveOnSignal(requeue="yes")


def test_launcher_config_composes(tmp_path):
    """hydra/launcher=slurm: nodes and tasks follow the trainer; the signal is USR1."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from longctx.train.resolvers import register_with_hydra

    register_with_hydra()
    overrides = ["hydra/launcher=slurm", "trainer=ddp", "trainer.num_nodes=1", "trainer.devices=8"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("SlurmLauncher")
    cfg.hydra.runtime.output_dir = str(tmp_path)  # what Hydra fills in at run time
    assert (cfg.hydra.launcher.nodes, cfg.hydra.launcher.tasks_per_node) == (1, 8)
    assert cfg.hydra.launcher.additional_parameters.signal == "USR1@90"


def slurm_task(monkeypatch, nodes: int, tasks_per_node: int, procid: int) -> None:
    """The environment srun gives one task of a job on nodes n1..n<nodes>."""
    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for var, value in {
        "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "7", "SLURM_NNODES": nodes,
        "SLURM_NTASKS": nodes * tasks_per_node, "SLURM_NTASKS_PER_NODE": tasks_per_node,
        "SLURM_NODELIST": f"n[1-{nodes}]", "SLURM_PROCID": procid,
        "SLURMD_NODENAME": f"n{procid // tasks_per_node + 1}",
    }.items():  # fmt: skip
        monkeypatch.setenv(var, str(value))


def test_allocation_mismatch_is_named(monkeypatch):
    from longctx.distributed.slurm import check_allocation

    slurm_task(monkeypatch, nodes=2, tasks_per_node=4, procid=0)
    check_allocation(2, 4)
    with pytest.raises(
        ValueError,
        match=re.escape("trainer.num_nodes=4, but this SLURM job runs on 2 node(s) (n[1-2])"),
    ):
        check_allocation(4, 4)
    with pytest.raises(
        ValueError, match=re.escape("trainer.devices=8, but SLURM starts 4 task(s) per node")
    ):
        check_allocation(2, 8)
    check_allocation(2, "auto")  # Lightning counts "auto" itself


def test_rank_zero_must_host_master_address(monkeypatch):
    from longctx.distributed.slurm import check_master_address

    slurm_task(monkeypatch, nodes=2, tasks_per_node=1, procid=0)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    with pytest.raises(ValueError, match=re.escape(
        "MASTER_ADDR=192.0.2.1 (192.0.2.1) is not an address of node n1, where global rank 0 "
        "runs and must accept the other 1 rank(s) on MASTER_PORT=29511")):  # fmt: skip
        check_master_address(world_size=2)
    check_master_address(world_size=1)  # one process: no rendezvous
    monkeypatch.setenv("SLURM_PROCID", "1")  # rank 1 connects; only rank 0 can tell
    check_master_address(world_size=2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    check_master_address(world_size=2)


def test_unresolvable_first_node_is_named(monkeypatch):
    """Without MASTER_ADDR the ranks meet at the allocation's first node: it must resolve."""
    from longctx.distributed.slurm import check_master_address

    slurm_task(monkeypatch, nodes=2, tasks_per_node=1, procid=1)
    monkeypatch.setenv("SLURM_NODELIST", "no-such-node[1-2].invalid")
    with pytest.raises(ValueError, match=re.escape(
        "MASTER_ADDR=no-such-node1.invalid (the first node of SLURM_NODELIST="
        "no-such-node[1-2].invalid): the rendezvous host does not resolve")):  # fmt: skip
        check_master_address(world_size=2)
    check_master_address(world_size=1)  # a single-task job never meets at the first node


def test_context_parallel_not_dividing_the_nodes_is_named(tmp_path):
    from helpers import FAST, compose

    from longctx.train.app import ConfigError, run

    overrides = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1",
                 "trainer.num_nodes=2", "parallel.context_parallel=4"]  # fmt: skip
    cfg = compose([*FAST, *overrides], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=re.escape(
        "parallel.context_parallel=4, parallel.context_parallel_rounds=1: context_parallel=4 "
        "must divide the world size 2 (processes x nodes)")):  # fmt: skip
        run(cfg)


def test_unresolvable_master_address_is_a_clear_error(tmp_path, monkeypatch):
    from helpers import FAST

    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    proc = run_train([*FAST, "trainer.max_steps=2", "run_name=nomaster"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "MASTER_ADDR=no-such-host.invalid: the rendezvous host does not resolve" in proc.stderr
    assert not list(tmp_path.rglob("*.ckpt"))
