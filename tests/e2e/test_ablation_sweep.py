"""notebooks/ablation_curves.ipynb executes against a tiny CPU ablation (offline W&B) and makes
its figures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from helpers import FAST, ROOT, run_train

NOTEBOOK = ROOT / "notebooks" / "ablation_curves.ipynb"
FIGURES = {"train_loss.png", "position_loss.png", "ablation.png", "held_out.png"}


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


@pytest.mark.slow
def test_notebook_executes_on_a_tiny_ablation(tmp_path, tiny_position_ablation):
    run_train(
        [
            *tiny_position_ablation,
            *FAST,
            "logger=wandb",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
        ],
        tmp_path,
    )  # fmt: skip  (experiment=position_ablation sets hydra.mode=MULTIRUN: no -m needed)
    assert len(list((tmp_path / "multirun").rglob("wandb/offline-run-*/*.wandb"))) == 4
    nb = execute_notebook(tmp_path / "multirun", tmp_path / "figures")
    kernel_python = cell_text(nb).split("kernel python: ")[1].split("\n")[0]
    assert Path(kernel_python).resolve() == Path(sys.executable).resolve()  # the venv's python
    assert "4 runs," in cell_text(nb)
    assert "| arm | seeds | held-out loss [95% CI] |" in cell_text(nb)
    written = {p.name for p in (tmp_path / "figures").glob("*.png")}
    assert written >= FIGURES
    assert all((tmp_path / "figures" / f).stat().st_size > 1000 for f in FIGURES)
