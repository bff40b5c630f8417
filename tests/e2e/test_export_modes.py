"""What longctx writes for others to read has the modes plain open/mkdir give under the user's
umask (0644 files, 0755 folders under 022): exports (staged through mkdtemp, weights written by
safetensors), prepared data folders (atomic writes through mkstemp) and run folders."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import pytest
from export_helpers import make_run
from helpers import FAST, run_train

from longctx.data.prepare import prepare
from longctx.hf.export import export


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root: Path) -> dict[str, set[int]]:
    """{"file": {modes}, "folder": {modes}} of everything under ``root`` (root included)."""
    found = {"file": set(), "folder": {stat.S_IMODE(root.stat().st_mode)}}
    for path in root.rglob("*"):
        kind = "folder" if path.is_dir() else "file"
        found[kind].add(stat.S_IMODE(path.lstat().st_mode))
    return found


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_an_export_is_readable_under_the_umask(tmp_path, mask):
    run = make_run(tmp_path)
    with umask(mask):
        out = export(run, tmp_path / "hf", max_shard_size="40KB").folder
    assert any(out.glob("model-*.safetensors"))  # safetensors' own writes are covered
    assert modes(out) == {"file": {0o666 & ~mask}, "folder": {0o777 & ~mask}}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_a_prepared_folder_is_readable_under_the_umask(tmp_path, mask):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    with umask(mask):
        prepare([jsonl], tmp_path / "out", "byte", workers=1, val_fraction=0.2, progress=False)
    assert modes(tmp_path / "out") == {"file": {0o666 & ~mask}, "folder": {0o777 & ~mask}}


@pytest.mark.slow
def test_a_run_folder_is_readable_under_the_umask(tmp_path):
    mask = 0o027
    with umask(mask):  # train.py inherits it
        run_train([*FAST, "trainer.max_steps=2", "trainer.val_check_interval=2"], tmp_path)
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert modes(run) == {"file": {0o666 & ~mask}, "folder": {0o777 & ~mask}}
