"""Shared app-test helpers: compose the real Hydra config, run train.py in a subprocess."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"  # what tests run in subprocesses
# the embedded corpus is prepared once per checkout and shared by every test (it is idempotent)
CACHE_DIR = ROOT / "data_cache"
# small and fast: every run of the app in tests shrinks the default config this way
FAST = [
    "logger=csv",
    "data.seq_len=256",
    "data.micro_batch_size=2",
    "data.val_rows=4",
    "trainer.val_check_interval=10",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    f"paths.cache_dir={CACHE_DIR}",
]


def compose(overrides: list[str], output_dir: Path | None = None):
    """The real train.yaml with overrides, as train.py would see it (minus Hydra's runtime)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from longctx.train.resolvers import register_with_hydra

    register_with_hydra()
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("train", overrides=overrides + extra)


def run_train(args: list[str], tmp_path: Path, timeout: int = 600, check: bool = True):
    """python train.py ARGS in a subprocess, outputs under tmp_path; returns CompletedProcess."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"paths.root_dir={tmp_path}"]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def train_losses(run_dir: Path) -> list[float]:
    return [float(r["train/loss"]) for r in read_metrics(run_dir) if r.get("train/loss")]


def final_params(run_dir: Path) -> dict:
    import torch

    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    return checkpoint["state_dict"]


def assert_close_scaled(actual, expected, rel: float = 1e-5, msg: str | None = None) -> None:
    """``actual`` equals ``expected`` up to ``rel`` x the largest ``|expected|``.

    fp32 round-off grows with the magnitudes summed and differs between CPUs (AMX, AVX-512,
    AVX2 kernels sum in different orders), so a fixed atol does not scale with the values
    compared, and a pure rtol fails on entries near zero whose error comes from larger terms.
    """
    import torch

    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    atol = rel * scale if scale > 0 else 0.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)


def write_run_record(run: Path, data: dict, group: str | None = None, seed: int = 0) -> Path:
    """A run folder as train.py leaves it for readers of its record: checkpoints/last.ckpt
    holding the run's config record (no weights: nothing here reads them)."""
    import torch

    from longctx.runs.folder import last_checkpoint
    from longctx.runs.record import CHECKPOINT_KEY

    config = {
        "model": {"_target_": "longctx.model.LlamaConfig.from_name", "name": "tiny"},
        "data": {"_target_": "longctx.data.DataConfig", **data},
        "run": {"group": group, "seed": seed, "tags": []},
    }
    path = last_checkpoint(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, CHECKPOINT_KEY: {"identity": {}, "config": config}}, path)
    return run


def same(a, b, where="") -> None:
    """Equal structures, floats to 1e-9 relative (a sum's rounding may differ between CPUs)."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), where
    else:
        assert a == b, where
