"""Issue 41's unclear cases: a bad callback setting or a NaN mixing weight is one line naming it,
with nothing left behind; `probe --out` is checked before the probe runs and never overwrites;
and a first run prints none of the noise it used to (runpy's warning for
`python -m longctx.data.prepare`, Lightning's GPU/TPU lines, the srun hint in the probe)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import CACHE_DIR, FAST, ROOT, compose

from longctx.probe import cli as probe_cli
from longctx.train.app import main

PROBE = ["data.seq_len=256", "data.micro_batch_size=2", "trainer.enable_progress_bar=false",
         f"paths.cache_dir={CACHE_DIR}"]  # fmt: skip


# ------------------------------------------------------------------ one line, nothing left
@pytest.mark.parametrize(
    "overrides, names",
    [
        (["callbacks=ruler", "callbacks.ruler.every_n_validations=0"],
         "callbacks.ruler: every_n_validations=0"),
        (["callbacks=ruler", "callbacks.ruler.factor=0"], "callbacks.ruler: factor=0"),
        (["data.weights=[nan]"], "DataConfig.weights=[nan]"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_naming_it_and_leaves_nothing(overrides, names, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(compose([*FAST, *overrides], output_dir=run_dir))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("error: ") and names in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert not run_dir.exists()


# ------------------------------------------------------------------ probe --out
@pytest.mark.parametrize("kind", ["file", "folder", "inside a file"])
def test_probe_out_is_checked_before_the_probe_runs(kind, tmp_path, monkeypatch, capsys):
    existing = tmp_path / "probe.json"
    if kind == "folder":
        existing.mkdir()
        out, message = existing, f"error: --out is a folder ({existing}); pass a file"
    else:
        existing.write_text("an earlier report\n")
        out, message = existing, f"error: --out exists ({existing}); pass a new file"
        if kind == "inside a file":
            out, message = existing / "probe.json", f"error: --out is inside a file ({existing})"
    runs = tmp_path / "runs"
    argv = ["probe", *PROBE, f"paths.root_dir={runs}", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        probe_cli.run()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err == [err[-1]] and err[-1].startswith(message), err
    assert not runs.exists()  # refused before anything was built or written
    if kind != "folder":
        assert existing.read_text() == "an earlier report\n"


# ------------------------------------------------------------------ a quiet first run
@pytest.mark.parametrize("module", ["longctx.data.prepare", "longctx.data.synthesize"])
def test_python_m_of_a_data_command_has_no_runpy_warning(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and "usage: python -m" in proc.stdout
    assert "RuntimeWarning" not in proc.stderr and "found in sys.modules" not in proc.stderr


def test_the_probe_prints_no_slurm_hint_or_device_lines(tmp_path):
    """With `srun` on PATH (a machine with SLURM installed), as train.py does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "probe.json"
    proc = subprocess.run(
        [sys.executable, "-m", "longctx.probe", *PROBE, f"paths.root_dir={tmp_path}",
         "--checks", "positions", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.is_file(), said[-3000:]
    noise = ("The `srun` command", "GPU available:", "TPU available:")
    assert not [n for n in noise if n in said], said[-3000:]
