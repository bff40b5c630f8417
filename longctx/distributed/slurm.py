"""SLURM: the job's identity, Lightning's environment plugin without its auto-requeue, and
requeueing a preempted job so that it resumes from the checkpoint it just wrote.

Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default) installs a SIGUSR1 handler
that saves an "hpc" checkpoint *inside the signal handler* and requeues; that would race
``longctx.callbacks.SaveOnSignal``, which checkpoints at the next step boundary. Under SLURM
the app therefore passes ``SLURMEnvironment(auto_requeue=False)`` and SaveOnSignal requeues.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

# written into the run folder when a job was requeued after a checkpoint: the next start of
# the same run resumes from checkpoints/last.ckpt (see longctx.checkpoint.auto_resume_path)
PREEMPTED_MARKER = "PREEMPTED"


def under_slurm() -> bool:
    """Inside a SLURM job allocation whose tasks Lightning can use as ranks."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def slurm_plugins() -> list:
    """[SLURMEnvironment(auto_requeue=False)] inside a SLURM job, else []."""
    if not under_slurm():
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)]


def restart_count() -> int:
    """How many times SLURM has requeued this job (0 outside SLURM)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def slurm_job_label() -> str | None:
    """The job's requeue-stable id: ``<array job>_<task>`` for an array task, else the job id."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_job(timeout: float = 60) -> str:
    """``scontrol requeue`` this job (or array task); returns the id. Raises with scontrol's
    message when SLURM refuses (e.g. the partition does not allow requeue)."""
    job = slurm_job_label()
    if job is None:
        raise RuntimeError("requeue_job: not inside a SLURM job (SLURM_JOB_ID is not set)")
    proc = subprocess.run(
        ["scontrol", "requeue", job], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"scontrol requeue {job} failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return job


def partition_nodes() -> tuple[dict[str, int], str | None] | None:
    """{partition: node count} and the default partition, from sinfo; None without a cluster."""
    if shutil.which("sinfo") is None:
        return None
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-a", "-o", "%P %D"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    counts: dict[str, int] = {}
    default = None
    for line in proc.stdout.split("\n"):
        if line.strip():
            name, count = line.split()
            if name.endswith("*"):
                name = default = name[:-1]
            counts[name] = counts.get(name, 0) + int(count)
    return counts, default


def checked_num_nodes(nodes, partition=None) -> int:
    """hydra.launcher.nodes: trainer.num_nodes, refused before submission when the partition
    does not exist or has fewer nodes (SLURM would otherwise queue the job forever unless the
    cluster sets EnforcePartLimits). Unchecked where sinfo cannot reach a cluster."""
    nodes = int(nodes)
    if nodes < 1:
        raise ValueError(f"trainer.num_nodes={nodes}: must be >= 1")
    found = partition_nodes()
    if found is None:
        return nodes
    counts, default = found
    name = partition or default
    if name not in counts:
        raise ValueError(
            f"hydra.launcher.partition={partition}: no such SLURM partition; this cluster has "
            f"{sorted(counts)}"
        )
    if nodes > counts[name]:
        raise ValueError(
            f"trainer.num_nodes={nodes} (hydra.launcher.nodes), but SLURM partition {name!r} has "
            f"only {counts[name]} node(s)"
        )
    return nodes


def check_master_address() -> None:
    """MASTER_ADDR (set by hand, or by a launcher) must at least resolve: an unresolvable
    rendezvous host would otherwise hang every rank until the process-group timeout."""
    address = os.environ.get("MASTER_ADDR")
    if not address:
        return
    try:
        socket.getaddrinfo(address, None)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(
            f"MASTER_ADDR={address}: the rendezvous host does not resolve ({err}); unset it "
            "under SLURM (Lightning takes the first node of the allocation) or fix the name"
        ) from err
