"""The local two-node SLURM (scripts/slurm/local_cluster.sh) as a pytest fixture."""

from __future__ import annotations

import atexit
import os
import subprocess

import pytest
from helpers import ROOT

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"


def cluster(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), cmd], capture_output=True, text=True, timeout=300)


def nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True)
    return sorted(set(out.stdout.split()))


@pytest.fixture(scope="module")
def slurm_cluster():
    """The local cluster, started here if `make test` has not (and stopped again afterwards).
    A running cluster of another layout (one node) is restarted as two by `start`."""
    if cluster("status").returncode == 0 and len(nodes()) >= 2:
        return
    if os.geteuid() != 0:
        pytest.skip(
            "SLURM is not running and starting it needs root (scripts/slurm/local_cluster.sh)"
        )
    started = cluster("start")
    if started.returncode != 0:
        pytest.skip(f"SLURM could not start here: {started.stderr.strip()[-500:]}")
    atexit.register(cluster, "stop")
