"""SLURM: the job's identity, Lightning's environment plugin without its auto-requeue, and
requeueing a preempted job so that it resumes from the checkpoint it just wrote.

Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default) installs a SIGUSR1 handler
that saves an "hpc" checkpoint *inside the signal handler* and requeues; that would race
``longctx.train.callbacks.SaveOnSignal``, which checkpoints at the next step boundary. Under SLURM
the app therefore passes ``SLURMEnvironment(auto_requeue=False)`` and SaveOnSignal requeues.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

from longctx.errors import LongctxError

# written into the run folder when a job was requeued after a checkpoint: the next start of
# the same run resumes from checkpoints/last.ckpt (see longctx.runs.checkpoints.auto_resume_path)
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
        raise LongctxError(f"trainer.num_nodes={nodes}: must be >= 1")
    found = partition_nodes()
    if found is None:
        return nodes
    counts, default = found
    name = partition or default
    if name not in counts:
        raise LongctxError(
            f"hydra.launcher.partition={partition}: no such SLURM partition; this cluster has "
            f"{sorted(counts)}"
        )
    if nodes > counts[name]:
        raise LongctxError(
            f"trainer.num_nodes={nodes} (hydra.launcher.nodes), but SLURM partition {name!r} has "
            f"only {counts[name]} node(s)"
        )
    return nodes


def check_allocation(num_nodes: int, devices) -> None:
    """Inside an srun step, trainer.num_nodes and trainer.devices must be the step's nodes and
    tasks per node (one task per device): otherwise the ranks' count and numbering disagree
    with the processes SLURM started, and they hang or collide in the rendezvous."""
    if not under_slurm():
        return
    nnodes = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES")
    nodelist = os.environ.get("SLURM_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "?")
    if nnodes is not None and int(nnodes) != int(num_nodes):
        raise LongctxError(
            f"trainer.num_nodes={num_nodes}, but this SLURM job runs on {nnodes} node(s) "
            f"({nodelist}); set trainer.num_nodes={nnodes} or allocate {num_nodes} node(s) "
            "(sbatch --nodes, hydra.launcher.nodes)"
        )
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    if isinstance(devices, int) and per_node.isdigit() and int(per_node) != devices:
        raise LongctxError(
            f"trainer.devices={devices}, but SLURM starts {per_node} task(s) per node "
            f"(--ntasks-per-node) and each task is one device; set trainer.devices={per_node}"
        )


def rendezvous_address(world_size: int) -> tuple[str, str] | None:
    """(host, where it comes from) that the ranks meet at: MASTER_ADDR, else for several ranks
    under SLURM the first node of the allocation (what Lightning's SLURMEnvironment picks);
    None where there is no rendezvous to check."""
    address = os.environ.get("MASTER_ADDR")
    if address:
        return address, f"MASTER_ADDR={address}"
    if world_size < 2 or not under_slurm():
        return None
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    nodelist = os.environ.get("SLURM_NODELIST", "127.0.0.1")
    first = SLURMEnvironment.resolve_root_node_address(nodelist)
    return first, f"MASTER_ADDR={first} (the first node of SLURM_NODELIST={nodelist})"


def is_first_rank() -> bool:
    """This process becomes global rank 0 (the one that hosts the rendezvous)."""
    if under_slurm():
        return os.environ.get("SLURM_PROCID", "0") == "0"
    return all(os.environ.get(v, "0") == "0" for v in ("RANK", "NODE_RANK", "LOCAL_RANK"))


def check_master_address(world_size: int = 1) -> None:
    """The rendezvous host must resolve (else every rank hangs until the process-group
    timeout), and with several ranks global rank 0 must run on it: rank 0 listens there on
    MASTER_PORT, the others connect to it, so an address of another machine is unreachable."""
    found = rendezvous_address(world_size)
    if found is None:
        return
    address, source = found
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise LongctxError(
            f"{source}: the rendezvous host does not resolve ({err}); unset it "
            "under SLURM (Lightning takes the first node of the allocation) or fix the name"
        ) from err
    if world_size > 1 and is_first_rank() and not any(map(_is_local, infos)):
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        ips = sorted({info[4][0] for info in infos})
        raise LongctxError(
            f"{source} ({', '.join(ips)}) is not an address of node {node}, where global rank "
            f"0 runs and must accept the other {world_size - 1} rank(s) on "
            f"MASTER_PORT={os.environ.get('MASTER_PORT', '(Lightning default)')}: they could "
            "never reach it. Unset MASTER_ADDR under SLURM (the first node of the allocation "
            "is used) or set it to an address of that node"
        )


def _is_local(info: tuple) -> bool:
    """An address this machine can listen on (getaddrinfo entry)."""
    family, _, _, _, sockaddr = info
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            return False
    return True
