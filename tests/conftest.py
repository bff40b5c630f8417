"""Skip GPU-marked tests on machines without CUDA; share the cores between xdist workers.

Layout: unit/ (in-process), e2e/ (train.py and multi-process runs), gpu/ (CUDA only, skipped
elsewhere), scripts/ (what e2e tests run in subprocesses), support/ (the shared helpers, importable
as ``helpers`` and ``module_fixtures`` from every test and script).
"""

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
SHARED = [str(TESTS / "support"), str(TESTS / "scripts")]
sys.path[:0] = SHARED
# the subprocesses tests start (scripts/, train.py with a test callback) import them too
os.environ["PYTHONPATH"] = os.pathsep.join([*SHARED, os.environ.get("PYTHONPATH", "")])


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # each worker (and the train.py runs it starts) gets its share of the cores:
        # oversubscribed OpenMP threads spin-wait for each other and slow every worker down
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    # the files with the most end-to-end (slow, slurm) tests first: with xdist's --dist loadfile
    # the long files start early and the short ones fill in the workers' ends (a stable sort
    # keeps each file's own order)
    heavy = Counter(item.path for item in items if {"slow", "slurm"} & set(item.keywords))
    items.sort(key=lambda item: -heavy[item.path])
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_position_ablation() -> list[str]:
    """Overrides that shrink ``experiment=position_ablation``: a small long-range mix beside the
    embedded corpus (synthesized into the cache on first use, its rows as long as data.seq_len),
    the 2x2 grid of one seed, the in-loop suite's tasks that fit 256 tokens, and a few held-out
    long-range answers (the held-out documents stay the whole val split)."""
    return ["experiment=position_ablation", "ruler_mix.documents=50", "seed=0",
            "callbacks.ruler.tasks=[lc_passkey,lc_niah_single,lc_copy]",
            "callbacks.held_out_answers.documents=8"]  # fmt: skip
