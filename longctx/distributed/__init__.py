"""Multi-process training: FSDP2 sharding (fsdp.py) and SLURM preemption / requeue (slurm.py)."""

from longctx.distributed.fsdp import FSDP2Strategy, apply_fsdp, transformer_blocks
from longctx.distributed.slurm import (
    PREEMPTED_MARKER,
    requeue_job,
    restart_count,
    slurm_job_label,
    slurm_plugins,
    under_slurm,
)

__all__ = [
    "FSDP2Strategy",
    "PREEMPTED_MARKER",
    "apply_fsdp",
    "requeue_job",
    "restart_count",
    "slurm_job_label",
    "slurm_plugins",
    "transformer_blocks",
    "under_slurm",
]
