"""python -m longctx.probe and callbacks=probe: the real config composed, the run built as
train.py builds it, probed at its start; tables and exit codes; one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import CACHE_DIR, ROOT, compose
from probe_fixtures import save_hf

from longctx.probe import cli, inject
from longctx.probe.callback import LeakDetected
from longctx.train.app import run

SMALL = [
    "data.seq_len=256",
    "data.micro_batch_size=2",
    "trainer.enable_progress_bar=false",
    f"paths.cache_dir={CACHE_DIR}",
]


def probe_cli(tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "probe.json"
    rc = cli.main([*SMALL, f"paths.root_dir={tmp_path}", "--out", str(out), *args])
    return rc, json.loads(out.read_text())


def by_check(report: dict) -> dict:
    return {r["check"]: r for r in report["results"]}


def test_tiny_on_cpu_passes(tmp_path, capsys):
    rc, report = probe_cli(tmp_path)
    assert rc == 0 and report["passed"], report["summary"]
    assert report["context"]["attn_backend"] == "sdpa"
    assert report["context"]["precision"] == "32-true"
    assert "| isolation/logits" in capsys.readouterr().out
    # the run's own rows: a micro-batch of the train stream with two documents in a row
    assert report["results"][0]["rows"].startswith("stage 0 batch ")


def test_eager_bf16_passes_with_bf16_tolerances(tmp_path):
    rc, report = probe_cli(tmp_path, "model.attn_backend=eager", "trainer.precision=bf16-mixed")
    assert rc == 0, report["summary"]
    assert by_check(report)["isolation/logits"]["tolerance"] == torch.finfo(torch.bfloat16).eps


def test_every_stage_is_probed(tmp_path):
    stages = "data.stages=[{until_step: 2, seq_len: 128, micro_batch_size: 4}]"
    rc, report = probe_cli(tmp_path, stages, "--checks", "positions,boundary_loss")
    assert rc == 0, report["summary"]
    names = {r["rows"] for r in report["results"]}
    # data.stages lists the stages before the last: 4 rows of 128 until step 2, then 2 of 256
    assert any(n.startswith("stage 0 ") and "4x128" in n for n in names), names
    assert any(n.startswith("stage 1 ") and "2x256" in n for n in names), names


def test_an_injected_leak_exits_1_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(inject.ENV, "causal_row")
    rc, report = probe_cli(tmp_path)
    assert rc == 1 and not report["passed"]
    assert report["first_failure"]["check"] == "isolation/logits"
    assert report["context"]["injected_bug"] == "causal_row"
    assert "leak probe: FAIL isolation/logits" in capsys.readouterr().err


# ------------------------------------------------------------------ model=hf


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_model_hf_passes(family, tmp_path):
    path = save_hf(family, tmp_path / family, vocab_size=300, hidden_size=64, intermediate_size=128)
    rc, report = probe_cli(tmp_path, "model=hf", f"model.path={path}", "model.attn_backend=sdpa")
    assert rc == 0, report["summary"]
    assert report["context"]["model"] == "HFCausalLM"


# ------------------------------------------------------------------ bad input: one line, exit 2
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--checks", "isolation,leaks"], "error: unknown check name (leaks); choose from"),
        (["--tolerance", "isolation=nan"], "error: tolerance isolation='nan' is not a finite"),
        (["--tolerance", "equivalence=-1"], "error: tolerance equivalence='-1' is not a finite"),
        (["--tolerance", "isolation"], "error: --tolerance (isolation) is not CHECK=VALUE"),
        (["--tolerance", "loss=1e-3"], "error: unknown check name in a tolerance (loss)"),
        (["data.document_mask=false"], "error: nothing to probe (data.document_mask=false)"),
        (["model.attn_backend=fast"], "error: model: "),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["probe", *SMALL, f"paths.root_dir={tmp_path}", *args])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith(message), err


# ------------------------------------------------------------------ callbacks=probe in a run
def test_callbacks_probe_passes_and_the_run_trains(tmp_path):
    overrides = ["callbacks=probe", "logger=csv", "trainer.max_steps=2", *SMALL]
    cfg = compose(overrides, output_dir=tmp_path / "run")
    metrics = run(cfg)
    assert "train/loss" in metrics
    report = json.loads((tmp_path / "run" / "probe.json").read_text())
    assert report["passed"], report["summary"]


def test_callbacks_probe_stops_a_leaking_run(tmp_path, monkeypatch):
    monkeypatch.setenv(inject.ENV, "causal_row")
    cfg = compose(["callbacks=probe", "logger=csv", "trainer.max_steps=2", *SMALL], tmp_path)
    with pytest.raises(LeakDetected, match=r"FAIL isolation/logits .* before its first step"):
        run(cfg)
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------ two processes over gloo
LAYOUTS = {
    "cp2": ["trainer=ddp", "parallel.context_parallel=2"],
    "fsdp2": ["trainer=fsdp"],  # every forward gathers the sharded parameters
}


@pytest.mark.slow  # two gloo processes under Lightning's launcher: about 40 s each
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_over_gloo(layout, tmp_path):
    out = tmp_path / "probe.json"
    two = ["trainer.accelerator=cpu", "trainer.devices=2", *LAYOUTS[layout]]
    cmd = [sys.executable, "-m", "longctx.probe", *SMALL, *two]
    cmd += [f"paths.root_dir={tmp_path}", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["context"]["world_size"] == 2
    assert report["context"]["context_parallel"] == (2 if layout == "cp2" else 1)
    assert proc.stdout.count("| isolation/logits") == 1  # rank 0 prints the table
