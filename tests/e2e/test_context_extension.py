"""The context-extension recipe end to end at toy size: scripts/context_extension.sh."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from helpers import CACHE_DIR, ROOT, compose
from hydra.utils import instantiate

from longctx.model import RopeScaling
from longctx.train.app import ConfigError, instantiate_config
from studies.extension_report import paired_differences

ARMS = {
    "unchanged": (10000.0, None),
    "abf": (500000.0, None),
    "linear": (10000.0, RopeScaling(type="linear", factor=8.0)),
    "yarn": (10000.0, RopeScaling(type="yarn", factor=8.0, original_max_position=32)),
}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_each_arm_sets_its_rope(arm, tmp_path):
    overrides = ["experiment=context_extension", f"rope_arm={arm}", "stage1_seq_len=32"]
    cfg = compose([*overrides, f"model.init_from={tmp_path}"], output_dir=tmp_path)
    model = instantiate(cfg.model)
    assert (model.rope_theta, model.rope_scaling) == ARMS[arm]
    assert model.init_from == str(tmp_path)


def test_stage_2_without_stage_1_is_refused(tmp_path):
    cfg = compose(["experiment=context_extension"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match="model.init_from is not set. stage 2 starts from"):
        instantiate_config("model", cfg.model)  # as train.py reads it


@pytest.mark.slow
def test_recipe_runs_end_to_end_at_toy_size(tmp_path):
    """Stage 1 (2 steps at 32 tokens), 4 arms of stage 2 (1 step at 256), the evaluation out to
    4 x 256 with the passkey probe, the table and the figure."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(ROOT),
        "LONGCTX_CACHE": str(CACHE_DIR),
        "SEEDS": "0",
        "SEQ1": "32",
        "MIX_DOCUMENTS": "40",
        "MIX_TASKS": "repeat",  # what fits stage 1's 32 tokens
        "RULER_SAMPLES": "1",
        "STEPS1": "2",
        "STEPS2": "1",
        "PROBE_SAMPLES": "1",
        "FIGURE": str(tmp_path / "figure.png"),
    }
    runs = tmp_path / "runs"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "context_extension.sh"), str(runs)],
        env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (sweep,) = (runs / "seed0" / "multirun" / "train").iterdir()
    report = json.loads((tmp_path / "figure_s0.json").read_text())
    assert sorted(r["arm"] for r in report["arms"]) == sorted(ARMS)
    for row in report["arms"]:
        assert row["seq_len"] == 256
        assert all(math.isfinite(row[f"loss_{m}x"]) for m in (1, 2, 4))
        assert {k for k in row if k.startswith("passkey_")} == {
            "passkey_256", "passkey_512", "passkey_1024"
        }  # fmt: skip
    assert (tmp_path / "figure_s0.png").stat().st_size > 0
    # the effective-length suite per arm, paired with unchanged RoPE
    suite = json.loads((tmp_path / "figure_ruler.json").read_text())
    assert suite["control"] == "unchanged" and suite["instance_seed"] == 0
    assert sorted(a["arm"] for a in suite["arms"]) == sorted(ARMS)
    assert suite["lengths"] == [192, 256, 512, 1024] and suite["train_seeds"] == [0]
    assert "| arm |" in proc.stdout
    # each arm against unchanged RoPE, per octave, paired over the same held-out books
    differences = {(d["arm"], d["multiple"]): d for d in report["differences"]}
    assert sorted(differences) == sorted(
        (a, m) for a in ARMS if a != "unchanged" for m in (1, 2, 4)
    )
    assert all(d["ci95"][0] <= d["delta"] <= d["ci95"][1] for d in differences.values())
    # every arm started from stage 1's weights, with its own RoPE
    for folder in sweep.glob("*rope_arm=*"):
        stored = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
        model = stored["longctx_run"]["config"]["model"]
        assert model["init_from"] == str(runs / "seed0" / "outputs" / "train" / "stage1")
        arm = folder.name.split("rope_arm=")[1].split(",")[0]
        assert model["rope_theta"] == ARMS[arm][0]


def fake_arm(folder, shift: float, tokens_at_2x: int = 1000):
    """Three documents, one record per octave of L=256; the arm's loss is unchanged's + shift."""
    (folder / "eval").mkdir(parents=True)
    rows = [
        {
            "doc": doc,
            "bucket_start": start,
            "tokens": tokens,
            "loss_sum": (1.0 + doc + shift) * tokens,
        }
        for doc in range(3)
        for start, tokens in [(128, 128), (256, tokens_at_2x), (512, 512)]
    ]
    pd.DataFrame(rows).to_csv(folder / "eval" / "long_documents_by_octave.csv", index=False)
    return folder


def test_paired_differences_against_unchanged_rope(tmp_path):
    folders = {"unchanged": fake_arm(tmp_path / "u", 0.0), "abf": fake_arm(tmp_path / "a", 0.25)}
    rows = paired_differences(folders, seq_len=256, n_boot=200)
    assert [(r["arm"], r["multiple"]) for r in rows] == [("abf", 1), ("abf", 2), ("abf", 4)]
    for row in rows:  # the same shift on every document: no spread to resample
        assert row["delta"] == pytest.approx(0.25)
        assert row["ci95"] == pytest.approx([0.25, 0.25])
    folders["abf"] = fake_arm(tmp_path / "other", 0.25, tokens_at_2x=999)
    with pytest.raises(ValueError, match="not unchanged's"):
        paired_differences(folders, seq_len=256)
