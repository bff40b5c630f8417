"""Exports open in transformers 4.x too: the byte tokenizer's export and a user tokenizer's,
checked by tests/scripts/export_tf4_check.py in a second virtualenv (scripts/setup_tf4_venv.sh) against
the ids and logits longctx computes here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from export_helpers import (
    longctx_model,
    make_run,
    make_user_run,
    make_user_tokenizer,
    model_overrides,
)
from helpers import ROOT, SCRIPTS

from longctx.batch import PackedBatch
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer
from longctx.hf.export import export

VENV = Path(os.environ.get("LONGCTX_TF4_VENV", ROOT / ".venv-tf4"))
PYTHON = VENV / "bin" / "python"
TEXTS = ["In the beginning", "a<s>b</s>c<pad>", "ünïcödé 🙂\t", "  spaces , and .punctuation"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not PYTHON.is_file(),
        reason=f"no transformers 4.x venv at {VENV}: run `bash scripts/setup_tf4_venv.sh` "
        "(or set LONGCTX_TF4_VENV)",
    ),
]


def case(name: str, run: Path, out: Path, tokenizer, tmp_path: Path) -> dict:
    ids = [tokenizer.encode(t).tolist() for t in TEXTS]
    tokens = torch.randint(0, 259, (1, 60), generator=torch.Generator().manual_seed(3))
    batch = PackedBatch.from_lengths(tokens, [[60]], reset_position_ids=True)
    with torch.no_grad():
        logits = longctx_model(run)(batch)[0]
    torch.save(logits, tmp_path / f"{name}.pt")
    record = json.loads((out / "longctx_export.json").read_text())
    return {
        "name": name,
        "folder": str(out),
        "texts": TEXTS,
        "ids": ids,
        "tokens": tokens[0].tolist(),
        "logits": str(tmp_path / f"{name}.pt"),
        "max_position_embeddings": record["max_position_embeddings"],
    }


def test_exports_open_in_transformers_4(tmp_path):
    byte_run = make_run(tmp_path / "byte")
    byte_out = export(byte_run, tmp_path / "byte-hf", max_shard_size="40KB").folder
    source = make_user_tokenizer(tmp_path / "tok")
    llama3 = "{type: llama3, factor: 8, original_max_position: 16}"
    user_run = make_user_run(tmp_path / "user", source, model_overrides(llama3))
    user_out = export(user_run, tmp_path / "user-hf").folder  # the data's tokenizer
    cases = [
        case("byte", byte_run, byte_out, ByteTokenizer(), tmp_path),
        case("user", user_run, user_out, HFTokenizer(source), tmp_path),
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of longctx
    proc = subprocess.run(
        [str(PYTHON), str(SCRIPTS / "export_tf4_check.py"), str(tmp_path / "cases.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["transformers"].startswith("4.")
    assert result["problems"] == {"byte": [], "user": []}
