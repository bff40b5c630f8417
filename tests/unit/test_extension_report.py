"""studies.extension_report over several training seeds: arms paired by seed with
unchanged RoPE, the per-document rows beside the JSON."""

from __future__ import annotations

import json

import pandas as pd
from helpers import write_run_record

from studies import extension_report as E

SEED_SHIFT = {0: 0.0, 1: 0.5, 2: -0.5}  # a large seed effect, shared by the arms of a seed


def fake_arm(root, arm: str, seed: int, shift: float):
    """A stage-2 arm as the recipe leaves it: run record, eval.json, per-octave and per-position
    records of four documents (L = 256: octaves start at 128, 256, 512)."""
    folder = root / f"seed{seed}" / "multirun" / "train" / "t" / f"rope_arm={arm},trainer.x=1"
    write_run_record(folder, {"seq_len": 256}, "context_extension", seed)
    (folder / "eval").mkdir()
    loss = lambda doc: 1.0 + 0.1 * doc + SEED_SHIFT[seed] + shift  # noqa: E731
    octaves = [{"doc": d, "bucket_start": s, "tokens": t, "loss_sum": loss(d) * t}
               for d in range(4) for s, t in [(128, 128), (256, 256), (512, 512)]]  # fmt: skip
    pd.DataFrame(octaves).to_csv(folder / "eval" / "long_documents_by_octave.csv", index=False)
    pd.DataFrame(octaves).to_csv(folder / "eval" / "long_documents.csv", index=False)
    summary = {
        "seq_len": 256,
        "long_documents": [{"multiple": m, "loss": 1.0} for m in (1, 2, 4)],
        "passkey": [{"length": 256, "depth": 0.5, "accuracy": 1.0}],
    }
    (folder / "eval" / "eval.json").write_text(json.dumps(summary))


def test_seeds_are_pooled_and_paired_with_unchanged(tmp_path):
    for seed in SEED_SHIFT:
        fake_arm(tmp_path, "unchanged", seed, 0.0)
        fake_arm(tmp_path, "abf", seed, 0.2)
    out = tmp_path / "ext.json"
    rows = E.main([str(tmp_path), "--json", str(out), "--out", str(tmp_path / "ext.png")])
    assert sorted((r["arm"], r["seed"]) for r in rows) == sorted(
        (a, s) for a in ("abf", "unchanged") for s in SEED_SHIFT
    )
    differences = json.loads(out.read_text())["differences"]
    assert [d["multiple"] for d in differences] == [1, 2, 4]
    for row in differences:  # the seed effect (+-0.5) cancels: every replicate sees +0.2
        assert row["paired"] and row["seeds"] == 3 and row["documents"] == 4
        assert abs(row["delta"] - 0.2) < 1e-9 and abs(row["ci95"][0] - 0.2) < 1e-9
        level = row["seed_level"]  # beside it, the t interval over the per-seed differences
        assert level["n"] == 3 and level["positive"] == 3
        assert abs(level["t_ci"][0] - 0.2) < 1e-9 and abs(level["t_ci"][1] - 0.2) < 1e-9
    assert "seed-level [+0.200, +0.200] (3+ 0−)" in json.loads(out.read_text())["markdown"]
    per_document = pd.read_csv(tmp_path / "ext_instances.csv.gz")
    assert len(per_document) == 2 * 3 * 3 * 4  # arms x seeds x octaves x documents


def test_one_folder_per_arm_is_one_seed(tmp_path):
    fake_arm(tmp_path, "unchanged", 0, 0.0)
    fake_arm(tmp_path, "linear", 1, 0.1)  # another seed: compared unpaired
    runs = {arm: {seed: f} for arm, seed, f in E.arm_runs(tmp_path)}
    (row, *_) = E.paired_differences(runs, 256, n_boot=100)
    assert not row["paired"] and abs(row["delta"] - 0.6) < 1e-9
