"""Every command line answers bad input with one line, ``error: ...``, and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

BIN = Path(sys.executable).parent
SCRIPTS = [
    "train", "plan", "eval", "export", "prepare", "convert", "analysis", "extension-report", "probe"
]  # fmt: skip


def run(argv: list[str], cwd: Path, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "WANDB_MODE": "disabled", **env}
    return subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", SCRIPTS)
def test_console_scripts_are_installed(name):
    assert (BIN / f"longctx-{name}").is_file(), f"longctx-{name}: reinstall with make setup"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["longctx-eval", "missing.ckpt"], "error: missing.ckpt does not exist"),
        (["longctx-export", "missing.ckpt", "--out", "x"], "missing.ckpt"),
        (["longctx-analysis"], "error: folder=None, --wandb=None; give either"),
        (["longctx-extension-report", "."], "holds no rope_arm=... run folders"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, tmp_path):
    proc = run([str(BIN / argv[0]), *argv[1:]], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_longctx_debug_shows_the_traceback(tmp_path):
    proc = run([str(BIN / "longctx-eval"), "missing.ckpt"], tmp_path, LONGCTX_DEBUG="1")
    assert proc.returncode == 2 and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: missing.ckpt does not exist")


def test_a_moved_key_names_its_new_place(tmp_path):
    for argv in (
        [sys.executable, str(ROOT / "train.py")],
        [str(BIN / "longctx-train")],
    ):
        proc = run([*argv, "trainer.context_parallel=2"], tmp_path)
        assert proc.returncode == 2
        assert proc.stderr.strip() == (
            "error: trainer.context_parallel moved to parallel.context_parallel "
            "(trainer.context_parallel=2); write parallel.context_parallel=2"
        )
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made a run folder
