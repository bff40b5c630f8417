"""What a resume may change (longctx.runs.resume; docs/reliability.md, "What a resume may
change"). Every optimizer and schedule setting is either applied as configured (the optimizer's
param groups and the schedule use it once the checkpoint is loaded, the log says so, the run
record holds it) or refused by name, with both values, unless ``allow_resume_changes`` lists
it, and then applied. In-process runs of a tiny model, a step or two each."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import FAST, compose

from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.folder import FolderState
from longctx.runs.record import read_stored_run
from longctx.train.app import ConfigError, run
from longctx.train.module import warmup_cosine_schedule

# warm-up of one step: the resumed step 2 is on the cosine, where every schedule setting shows
BASE = [*FAST, "trainer.limit_val_batches=0", "optim.scheduler.warmup_steps=1"]
# what the base run trains with, and a resume that changes nothing but a longer trainer.max_steps
CONFIGURED = {
    "optim.optimizer.lr": 3e-3,
    "optim.optimizer.betas": [0.9, 0.95],
    "optim.optimizer.eps": 1e-8,
    "optim.weight_decay": 0.1,
    "optim.grad_clip": 1.0,
    "optim.scheduler.warmup_steps": 1,
    "optim.scheduler.min_lr_ratio": 0.1,
    "optim.skip_nonfinite": 0,
    "trainer.max_steps": 3,
}
# refused unless allowed, then applied: (command-line value, value)
REFUSED_UNLESS_ALLOWED = {
    "optim.optimizer.lr": ("1.0e-3", 1e-3),
    "optim.optimizer.betas": ("[0.8,0.9]", [0.8, 0.9]),
    "optim.optimizer.eps": ("1.0e-6", 1e-6),
    "optim.weight_decay": ("0.05", 0.05),
    "optim.grad_clip": ("0.5", 0.5),
    "optim.scheduler.warmup_steps": ("4", 4),
    "optim.scheduler.min_lr_ratio": ("0.5", 0.5),
}
# applied as configured, and said
APPLIED = {"trainer.max_steps": ("4", 4), "optim.skip_nonfinite": ("2", 2)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 steps with its last checkpoint (never written to: each test copies it)."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    run(compose([*BASE, "trainer.max_steps=2"], output_dir=run_dir))
    return run_dir


def resume(trained, tmp_path, overrides: list[str]):
    """Resume a copy of the trained run for one step; returns (what it trained with, folder)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    probe = tmp_path / "probe.json"
    args = [*BASE, "ckpt_path=last", "trainer.max_steps=3", *overrides,
            "+callbacks.probe._target_=optim_probe.OptimizerProbe", f"+callbacks.probe.path={probe}"]  # fmt: skip
    run(compose(args, output_dir=run_dir))
    return json.loads(probe.read_text()), run_dir


def assert_in_effect(seen: dict, settings: dict) -> None:
    """The optimizer and schedule of the resumed step use exactly ``settings``."""
    probe_opt = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    schedule = warmup_cosine_schedule(
        probe_opt,
        settings["trainer.max_steps"],
        settings["optim.scheduler.warmup_steps"],
        settings["optim.scheduler.min_lr_ratio"],
    )
    assert seen["last_epoch"] == 2
    factor = schedule.lr_lambdas[0](seen["last_epoch"])
    lr = settings["optim.optimizer.lr"]
    assert seen["base_lrs"] == [lr, lr]
    for i, group in enumerate(seen["groups"]):
        assert group["initial_lr"] == lr
        assert group["lr"] == pytest.approx(lr * factor, rel=1e-12), (group["lr"], lr, factor)
        assert group["betas"] == settings["optim.optimizer.betas"]
        assert group["eps"] == settings["optim.optimizer.eps"]
        assert group["weight_decay"] == (settings["optim.weight_decay"] if i == 0 else 0.0)
    assert seen["grad_clip"] == settings["optim.grad_clip"]
    assert seen["skip_nonfinite"] == settings["optim.skip_nonfinite"]


@pytest.mark.parametrize("key", list(REFUSED_UNLESS_ALLOWED))
def test_a_changed_setting_is_refused_by_name_unless_allowed_and_then_applied(
    key, trained, tmp_path, capsys
):
    typed, value = REFUSED_UNLESS_ALLOWED[key]
    copy = tmp_path / "refused"
    shutil.copytree(trained, copy)
    before = FolderState.of(copy)
    with pytest.raises(ConfigError) as refused:
        run(compose([*BASE, "ckpt_path=last", "trainer.max_steps=3", f"{key}={typed}"], copy))
    message = str(refused.value)
    assert f"{key}: {CONFIGURED[key]!r} (checkpoint) -> {value!r} (now)" in message, message
    assert f"allow_resume_changes=[{key}]" in message
    assert FolderState.of(copy) == before  # the refused start left nothing

    seen, run_dir = resume(trained, tmp_path, [f"{key}={typed}", f"allow_resume_changes=[{key}]"])
    assert_in_effect(seen, CONFIGURED | {key: value})
    said = capsys.readouterr().out
    assert f"allowed by allow_resume_changes: {key}: {CONFIGURED[key]!r} -> {value!r}" in said
    assert read_stored_run(run_dir, CONFIG_TARGETS).config["training"][key] == value


@pytest.mark.parametrize("key", [None, *APPLIED])
def test_a_resume_applies_the_schedule_length_and_the_nonfinite_allowance(
    key, trained, tmp_path, capsys
):
    """None: a resume that changes nothing (but trains one step longer) trains with the
    configured settings too, its lr on the configured schedule from the first resumed step."""
    typed, value = APPLIED.get(key, (None, None))
    seen, run_dir = resume(trained, tmp_path, [f"{key}={typed}"] if key else [])
    settings = CONFIGURED | ({key: value} if key else {})
    assert_in_effect(seen, settings)
    if key:
        old = 2 if key == "trainer.max_steps" else CONFIGURED[key]
        assert f"applied as configured: {key}: {old!r} -> {value!r}" in capsys.readouterr().out
    stored = read_stored_run(run_dir, CONFIG_TARGETS).config["training"]
    assert {k: stored[k] for k in settings} == settings


def test_the_optimizer_class_is_never_changed_by_a_resume(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    change = ["ckpt_path=last", "trainer.max_steps=3", "optim.optimizer._target_=torch.optim.Adam"]
    for allow in ([], ["allow_resume_changes=[optim.optimizer._target_]"]):
        with pytest.raises(ConfigError, match=r"optim.optimizer._target_: 'torch.optim.AdamW' "
                           r"\(checkpoint\) -> 'torch.optim.Adam' \(now\); a resume cannot"):  # fmt: skip
            run(compose([*BASE, *change, *allow], copy))


def test_an_unknown_name_in_allow_resume_changes_is_refused(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    args = [*BASE, "ckpt_path=last", "trainer.max_steps=3", "allow_resume_changes=[optim.lrr]"]
    with pytest.raises(ConfigError, match=r"\['optim.lrr'\] not among the run's settings.*optim"):
        run(compose(args, copy))


def test_an_unknown_name_in_allow_resume_changes_is_refused_on_a_fresh_start(tmp_path):
    """A misspelt name once trained a fresh run and waited for the resume it was meant for."""
    args = [*BASE, "allow_resume_changes=[optim.lrr]"]
    with pytest.raises(ConfigError, match=r"\['optim.lrr'\] not among the run's settings"):
        run(compose(args, tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ the data settings
def test_a_resume_that_switches_add_bos_is_refused_by_name_unless_allowed(
    trained, tmp_path, capsys
):
    """data.add_bos changes every row (a BOS before each document); a resume once switched it
    on without a word: it was in neither the run identity nor the data stream's fingerprint."""
    copy = tmp_path / "refused"
    shutil.copytree(trained, copy)
    before = FolderState.of(copy)
    args = [*BASE, "ckpt_path=last", "trainer.max_steps=3", "data.add_bos=true"]
    with pytest.raises(ConfigError) as refused:
        run(compose(args, copy))
    message = str(refused.value)
    assert "data.add_bos: None (checkpoint) -> True (now)" in message, message
    assert "allow_resume_changes=[data.add_bos]" in message
    assert FolderState.of(copy) == before

    seen, run_dir = resume(trained, tmp_path, ["data.add_bos=true",
                                               "allow_resume_changes=[data.add_bos]"])  # fmt: skip
    assert "allowed by allow_resume_changes: data.add_bos: None -> True" in capsys.readouterr().out
    assert read_stored_run(run_dir, CONFIG_TARGETS).identity["data.add_bos"] is True


def test_every_data_setting_is_decided_for_a_resume(tmp_path):
    """Each DataConfig field is in exactly one of longctx.runs.resume's lists: the stream (the
    run's identity), the row order (the data stream's fingerprint), or neither; a new field
    fails here until it is placed."""
    import dataclasses

    from data_fixtures import small_corpus

    from longctx.data import DataConfig, LongCtxDataModule
    from longctx.runs.resume import ORDER_DATA_KEYS, OTHER_DATA_KEYS, STREAM_DATA_KEYS

    lists = (STREAM_DATA_KEYS, ORDER_DATA_KEYS, OTHER_DATA_KEYS)
    placed = [key for keys in lists for key in keys]
    fields = [f.name for f in dataclasses.fields(DataConfig)]
    assert sorted(placed) == sorted(fields), set(placed) ^ set(fields)
    # the row-order keys are the data stream's to refuse: its fingerprint holds each
    config = DataConfig(shards=[str(small_corpus(tmp_path, 50))], seq_len=64, buffer_size=8,
                        chunk_documents=24)  # fmt: skip
    fingerprint = LongCtxDataModule(config, rank=0, world_size=1).state_dict()["fingerprint"]
    assert set(ORDER_DATA_KEYS) - {"num_workers"} <= set(fingerprint)
