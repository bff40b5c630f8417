"""studies.ood_report: the exact-answer rate per arm and length from studies.ood_control's files,
and each arm's seed-paired difference from the control."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from longctx.errors import LongctxError
from studies.ood_report import main

MASKED, UNMASKED = "masked, reset pos", "unmasked, reset pos"


def write_reading(folder, arm: str, seed: int, length: int, exact: list[int]) -> None:
    """One run's reading as ood_control writes it: two answers a document."""
    name = f"{arm.replace(', ', '_').replace(' ', '_')}_s{seed}_at{length}"
    rows = [{"seed": seed, "doc": i // 2, "task": "ood_ledger", "answer": i % 2, "start": 10,
             "tokens": 6, "loss_sum": 1.0, "right_tokens": 6 * e, "exact": e,
             "generated_exact": e, "other_value": 1 - e} for i, e in enumerate(exact)]  # fmt: skip
    folder.mkdir(exist_ok=True)
    pd.DataFrame(rows).to_csv(folder / f"{name}.csv", index=False)
    meta = {"run": name, "seed": seed, "length": length, "arm": arm, "train_len": 2048}
    (folder / f"{name}.json").write_text(json.dumps(meta))


def test_rates_and_paired_differences_per_length(tmp_path):
    folder = tmp_path / "ood_position"
    for seed, (masked, unmasked) in enumerate([([1, 1, 1, 0], [1, 0, 0, 0]),
                                               ([1, 1, 0, 0], [0, 0, 0, 0])]):  # fmt: skip
        write_reading(folder, MASKED, seed, 256, masked)
        write_reading(folder, UNMASKED, seed, 256, unmasked)
        write_reading(folder, MASKED, seed, 2048, [0, 0, 0, 0])
        write_reading(folder, UNMASKED, seed, 2048, [0, 0, 0, 1])
    out = tmp_path / "ood_position.json"
    summary = main([str(folder), "--json", str(out), "--bootstrap", "200", "--note", "n"])
    assert json.loads(out.read_text()) == summary and summary["note"] == "n"
    short, long = summary["lengths"]
    assert (short["length"], long["length"], short["answers"]) == (256, 2048, 4)
    arms = {a["arm"]: a for a in short["arms"]}
    assert list(arms) == [MASKED, UNMASKED]  # the arms' table order
    assert arms[MASKED]["value"] == pytest.approx(5 / 8)
    assert arms[MASKED]["seed_values"] == {"0": 0.75, "1": 0.5}
    assert arms[UNMASKED]["other_value"] == pytest.approx(7 / 8)
    (pair,) = short["pairs"]
    assert (pair["a"], pair["b"]) == (UNMASKED, MASKED)
    assert pair["delta"] == pytest.approx(1 / 8 - 5 / 8)
    assert pair["seed_level"]["negative"] == 2 and pair["ci"][1] < 0
    assert long["pairs"][0]["delta"] == pytest.approx(1 / 4)
    answers = pd.read_csv(tmp_path / "ood_position_instances.csv.gz")
    assert len(answers) == 32 and set(answers["arm"]) == {MASKED, UNMASKED}


def test_a_missing_control_or_a_foreign_json_is_refused(tmp_path):
    folder = tmp_path / "readings"
    write_reading(folder, UNMASKED, 0, 256, [1, 0])
    with pytest.raises(LongctxError, match="--control 'masked, reset pos' is not among"):
        main([str(folder), "--json", str(tmp_path / "o.json")])
    (folder / "other.json").write_text("{}")
    with pytest.raises(LongctxError, match="other.json has no arm"):
        main([str(folder), "--json", str(tmp_path / "o.json")])
    with pytest.raises(FileNotFoundError, match="no studies.ood_control JSON"):
        main([str(tmp_path / "empty"), "--json", str(tmp_path / "o.json")])
