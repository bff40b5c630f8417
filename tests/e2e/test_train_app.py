"""The Hydra app: every config composes, train.py trains, resumes exactly, refuses bad configs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    CACHE_DIR,
    FAST,
    ROOT,
    compose,
    final_params,
    read_metrics,
    run_train,
    train_losses,
)
from hydra.utils import instantiate
from omegaconf import OmegaConf

from longctx.data.arms import arm_description
from longctx.distributed.layout import ParallelConfig
from longctx.model import Llama, LlamaConfig
from longctx.train.app import ConfigError, run

CONF = ROOT / "conf"
GOLDEN = ROOT / "tests" / "assets" / "golden_tiny_loss.json"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group", ["model", "data", "trainer", "optim", "logger", "callbacks", "paths", "debug"]
)
def test_every_group_option_composes(group, tmp_path):
    for option in options(group):
        overrides = [f"{group}={option}"]
        if group == "data" and option == "shards":
            overrides.append(f"data.shards=[{tmp_path}]")
        cfg = compose(overrides, output_dir=tmp_path)
        OmegaConf.resolve(cfg)  # every interpolation resolves
        if group == "debug":  # a global package: it shrinks the run
            assert cfg.trainer.max_steps <= 10
        else:
            assert group in cfg


@pytest.mark.parametrize("experiment", options("experiment"))
def test_every_experiment_composes(experiment, tmp_path):
    overrides = [f"experiment={experiment}"]
    if experiment in ("context_extension", "recall", "recall_ablation"):  # stage 2 of a recipe
        overrides.append(f"model.init_from={tmp_path}")  # needs stage 1's weights
    cfg = compose(overrides, output_dir=tmp_path)
    OmegaConf.resolve(cfg)
    assert instantiate(cfg.model).n_layers >= 1
    assert instantiate(cfg.data).seq_len >= 1


# model=hf needs a checkpoint folder (model.path): tests/test_hf_any_model.py covers it
@pytest.mark.parametrize("preset", [p for p in options("model") if p != "hf"])
def test_instantiate_each_model_preset(preset, tmp_path):
    cfg = compose([f"model={preset}", *FAST], output_dir=tmp_path)
    config: LlamaConfig = instantiate(cfg.model)
    assert isinstance(config, LlamaConfig)
    with torch.device("meta"):  # 8B and 1B only ever on the meta device here
        model = Llama(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    assert instantiate(cfg.parallel) == ParallelConfig()  # trainer: is Lightning's keys only
    trainer = instantiate(cfg.trainer, logger=False, callbacks=[])
    assert trainer.max_steps == cfg.trainer.max_steps


def test_instantiate_datamodule_and_module(tmp_path):
    from longctx.data import LongCtxDataModule
    from longctx.train.app import optim_config
    from longctx.train.module import LongCtxModule

    cfg = compose(FAST, output_dir=tmp_path)
    datamodule = LongCtxDataModule(instantiate(cfg.data))
    module = LongCtxModule(instantiate(cfg.model), optim_config(cfg.optim))
    assert datamodule.config.seq_len == 256
    assert module.model.config.dim == 256


def test_smoke_training_through_train_py(tmp_path):
    args = [*FAST, "run_name=smoke", "trainer.max_steps=40", "optim.scheduler.warmup_steps=5"]
    proc = run_train(args, tmp_path)
    run_dir = tmp_path / "outputs" / "train" / "smoke"
    losses = train_losses(run_dir)
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    val = [float(r["val/loss"]) for r in read_metrics(run_dir) if r.get("val/loss")]
    assert len(val) == 4 and val[-1] < val[0]
    summary = re.search(r"val/loss ([\d.]+) nats/token, unigram baseline ([\d.]+)", proc.stdout)
    assert summary and float(summary[1]) == pytest.approx(val[-1], abs=1e-3)
    arm_lines = [line for line in proc.stdout.splitlines() if line.startswith("arm: ")]
    assert arm_lines == [arm_description(True, True)], arm_lines  # once, naming the default arm
    # 40 steps of 512 tokens already beat a model that knows every byte's frequency
    assert float(summary[1]) < float(summary[2]), summary[0]


RESUME = [
    *FAST,
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "trainer.deterministic=true",
]


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    keep = ["callbacks.checkpoint.every_n_train_steps=4", "callbacks.checkpoint.save_top_k=-1"]
    run_train([*RESUME, *keep, "run_name=full"], tmp_path)
    full = tmp_path / "outputs" / "train" / "full"
    # each step's file holds that step (a validation's logged step once named the step-8 save)
    saved = {p.name: torch.load(p, weights_only=True)["global_step"]
             for p in (full / "checkpoints").glob("*step=*.ckpt")}  # fmt: skip
    assert saved == {"epoch=0-step=4.ckpt": 4, "epoch=0-step=8.ckpt": 8}
    mid = tmp_path / "step4.ckpt"  # a plain name: '=' in Lightning's would need Hydra quoting
    next((full / "checkpoints").glob("*step=4.ckpt")).rename(mid)
    run_train([*RESUME, "run_name=resumed", f"ckpt_path={mid}"], tmp_path)
    resumed = tmp_path / "outputs" / "train" / "resumed"
    assert train_losses(resumed) == train_losses(full)[4:]
    a, b = final_params(full), final_params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_matches(tmp_path):
    steps = ["trainer.max_steps=30", "callbacks.checkpoint.every_n_train_steps=5"]
    run_train([*RESUME, *steps, "run_name=full"], tmp_path)
    killed = tmp_path / "outputs" / "train" / "killed"
    cmd = [sys.executable, str(ROOT / "train.py"), f"paths.root_dir={tmp_path}", *RESUME, *steps]
    proc = subprocess.Popen(
        [*cmd, "run_name=killed"],
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "last.ckpt").exists() and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # mid-run: the first checkpoint is at step 5 of 30
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    stopped_at = torch.load(killed / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 5 <= stopped_at < 30, out[-3000:]
    run_train([*RESUME, *steps, "run_name=killed", "ckpt_path=last"], tmp_path)
    a, b = final_params(tmp_path / "outputs" / "train" / "full"), final_params(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_golden_loss_curve(tmp_path):
    """The tiny model's first 20 losses under deterministic CPU settings (tests/assets)."""
    expected = json.loads(GOLDEN.read_text())
    run_train([*expected["overrides"], f"paths.cache_dir={CACHE_DIR}", "run_name=golden"], tmp_path)
    losses = train_losses(tmp_path / "outputs" / "train" / "golden")
    assert losses == pytest.approx(expected["losses"], rel=1e-4, abs=1e-4)


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(Exception, match="data.sequence_len"):
        compose([*FAST, "data.sequence_len=512"], output_dir=tmp_path)


@pytest.mark.parametrize(
    "override, names",
    [
        ("model.attn_backend=flash", "model.attn_backend=flash"),
        ("trainer.devices=64", "trainer.devices=64"),
        ("model.attn_backend=flex data.seq_len=1000", "data.seq_len=1000"),
        ("data.seq_len=262144", "data.seq_len=262144"),
        ("data.packer=first_fit", "packer"),
        (
            "model.attn_backend=flex",
            "model.attn_backend=flex, data.seq_len=256: attn_backend='flex' on CPU is forward-only",
        ),
    ],
)
def test_bad_config_stops_before_training(override, names, tmp_path):
    cfg = compose([*FAST, *override.split()], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=re.escape(names)):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists()


def test_8b_refuses_without_memory_and_dry_run_works(tmp_path):
    proc = run_train(
        ["model=llama3_8b", "data.reset_position_ids=false", *FAST], tmp_path, check=False
    )
    assert proc.returncode != 0
    assert "8,030,261,248 parameters" in proc.stderr and "GiB" in proc.stderr
    dry = run_train(["model=llama3_8b", "dry_run=true", *FAST], tmp_path)
    assert "8,030,261,248 parameters" in dry.stdout
    job = run_train(["--cfg", "job", "model=llama3_8b"], tmp_path)  # flags first
    assert "llama3_8b" in job.stdout
