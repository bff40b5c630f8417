"""data.dp_balance end to end: a balanced optimizer step's loss and gradients equal the
unbalanced step's over gloo ranks, with gradient accumulation, alone and with context
parallelism (tests/scripts/dp_balance_script.py); train/dp_work_imbalance is logged every step."""

from __future__ import annotations

import subprocess
import sys

import pytest
from data_fixtures import small_corpus
from helpers import FAST, SCRIPTS, read_metrics, run_train


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"), 300)


@pytest.mark.parametrize(
    "world,context_parallel,accumulation",
    [(2, 1, 3), (4, 2, 2)],  # 2 data-parallel ranks; the second splits every row over 2
)
def test_balanced_step_equals_the_unbalanced_one(folder, world, context_parallel, accumulation):
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "dp_balance_script.py"),
            str(folder),
            str(world),
            str(context_parallel),
            str(accumulation),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "equal" in proc.stdout


def test_train_logs_dp_work_imbalance_every_step_with_balancing_on(tmp_path):
    """train.py on 2 DDP ranks with accumulation 2 and data.dp_balance=true: the app hands the
    planner's row cost to the data and the module, and every step logs
    train/dp_work_imbalance (max / mean of the ranks' predicted cost, >= 1)."""
    run_train(
        [
            *FAST,
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.max_steps=3",
            "optim.accumulate_grad_batches=2",
            "data.dp_balance=true",
            "run_name=balanced",
        ],
        tmp_path,
    )
    rows = [
        r for r in read_metrics(tmp_path / "outputs" / "train" / "balanced") if r.get("train/loss")
    ]
    assert len(rows) == 3
    assert all(1.0 <= float(r["train/dp_work_imbalance"]) < 2.0 for r in rows), rows
