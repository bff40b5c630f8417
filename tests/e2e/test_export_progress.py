"""Long CLI work (prepare, convert, export) shows a progress bar on a terminal, nothing when
stdout is a pipe, and ends with what it wrote and the next command to run."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios

from export_helpers import make_run
from helpers import ROOT


def run_cli(args: list[str], terminal: bool) -> str:
    """stdout (and stderr) of ``python -m ARGS``, on a pseudo-terminal or a pipe."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    if not terminal:
        proc = subprocess.run(
            [sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))  # a sized one
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode(errors="replace")


def test_prepare_shows_a_bar_on_a_terminal_only_and_the_next_command(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(50)))
    args = [
        "longctx.data.prepare",
        str(jsonl),
        "--workers",
        "1",
        "--tasks",
        "2",
        "--val-fraction",
        "0",
    ]
    shown = run_cli([*args, "--out", str(tmp_path / "a")], terminal=True)
    assert "prepare: 100%" in shown and "B/s" in shown
    piped = run_cli([*args, "--out", str(tmp_path / "b")], terminal=False)
    assert "%|" not in piped and "\r" not in piped
    for out, name in ((shown, "a"), (piped, "b")):
        assert f"wrote {tmp_path / name}" in out
        assert f"next: python train.py data=shards data.shards={tmp_path / name}" in out


def test_export_shows_a_bar_on_a_terminal(tmp_path):
    run = make_run(tmp_path)
    out = run_cli(["longctx.hf.export", str(run), "--out", str(tmp_path / "hf")], terminal=True)
    assert "writing weights: 100%" in out
    assert f"next: python -m longctx.hf.verify {tmp_path / 'hf'}" in out


def test_convert_shows_a_bar_on_a_terminal_and_the_next_command(tmp_path):
    import datasets

    rows = {"input_ids": [[1, 2, 3, 0], [4, 5, 0]] * 50}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "src"))
    args = ["longctx.data.convert", str(tmp_path / "src"), "--vocab-size", "8", "--eos-id", "0"]
    shown = run_cli([*args, "--val-fraction", "0.2", "--out", str(tmp_path / "a")], terminal=True)
    assert "convert: " in shown and "tok/s" in shown
    assert f"next: python train.py data=shards data.shards={tmp_path / 'a'}" in shown
