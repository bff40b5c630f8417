"""A tiny CPU position ablation (experiment=position_ablation, the 2x2 grid of one seed, offline
W&B), trained once for the module: every arm records its group and toggles, says what it computes
and is scored on the same held-out documents; notebooks/ablation_curves.ipynb executes against it
and makes its figures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import FAST, ROOT, run_train

from longctx.data.arms import arm_description
from studies.ablation import summarize
from studies.analysis import load_local

NOTEBOOK = ROOT / "notebooks" / "ablation_curves.ipynb"
FIGURES = {"train_loss.png", "position_loss.png", "ablation.png", "held_out.png"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_position_ablation):
    """python train.py -m with the tiny ablation: (its multirun folder, its stdout)."""
    root = tmp_path_factory.mktemp("ablation")
    proc = run_train(
        [
            "-m",
            *tiny_position_ablation,
            *FAST,
            "logger=wandb",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
        ],
        root,
    )
    return root / "multirun", proc.stdout


def test_ablation_multirun_offline_wandb(sweep):
    multirun, stdout = sweep
    runs = list(multirun.rglob("wandb/offline-run-*"))
    assert len(runs) == 4, runs
    assert len(list(multirun.rglob("wandb/offline-run-*/*.wandb"))) == 4
    # each arm's checkpoint records its group and toggles; the analysis reads them with the
    # CSV log every run writes beside W&B's
    frame = load_local(multirun)
    toggles = set(zip(frame.reset_position_ids, frame.document_mask, strict=True))
    assert toggles == {(True, True), (True, False), (False, True), (False, False)}
    assert set(frame["group"]) == {"position_ablation"}
    assert {"train/loss", "val/held_out_loss"} <= set(frame["metric"])
    # each arm said what it computes, and was scored on the same held-out documents
    assert {arm_description(r, m) for r, m in toggles} <= set(stdout.splitlines())
    summary = summarize(multirun, n_boot=200)
    assert len(summary["arms"]) == 4 and len(summary["pairs"]) == 6
    assert 10 <= summary["documents"] <= 64  # the val split's first documents, up to 64


def execute_notebook(source: Path, fig_dir: Path):
    """Run every cell in a python3 kernel (the venv's python) with the notebook's env vars."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"ABLATION_SOURCE": str(source), "ABLATION_FIG_DIR": str(fig_dir),
           "ABLATION_WANDB_PROJECT": ""}  # fmt: skip
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, kernel_name="python3", timeout=300,
                       resources={"metadata": {"path": str(ROOT)}}).execute()  # fmt: skip
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def cell_text(nb) -> str:
    return "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )  # fmt: skip


def test_notebook_executes_on_a_tiny_ablation(sweep, tmp_path):
    multirun, _ = sweep
    nb = execute_notebook(multirun, tmp_path / "figures")
    kernel_python = cell_text(nb).split("kernel python: ")[1].split("\n")[0]
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve()  # the venv's python
    assert "4 runs," in cell_text(nb)
    assert "| arm | seeds | held-out loss [95% CI] |" in cell_text(nb)
    written = {p.name for p in (tmp_path / "figures").glob("*.png")}
    assert written >= FIGURES
    assert all((tmp_path / "figures" / f).stat().st_size > 1000 for f in FIGURES)
