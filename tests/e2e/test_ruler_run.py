"""The effective-length suite in a trained run: the in-loop callback (CSV and its offline W&B
table), the eval CLI on a checkpoint, and a transformers export scored as its run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import CACHE_DIR, FAST, assert_close_scaled, run_train

from longctx.batch import IGNORE_INDEX
from longctx.data import ByteTokenizer
from longctx.eval import cli
from longctx.eval.ruler import answer_logits, instance_batch, make_instances
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.runs.record import read_stored_run

TOK = ByteTokenizer()


# -------------------------------------------------------- a trained run: callback, CLI, HF
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two steps of tiny_long with the suite in the loop, logged to offline W&B (and its CSV)."""
    tmp = tmp_path_factory.mktemp("rulerrun")
    run_train([*FAST, "run_name=r", "model=tiny_long", "logger=wandb", "callbacks=ruler",
               "data.seq_len=256", "trainer.max_steps=2", "trainer.val_check_interval=1",
               "callbacks.ruler.tasks=[lc_passkey,lc_copy]", "callbacks.ruler.lengths=[128,256]",
               "callbacks.ruler.depths=[0.0,1.0]", "callbacks.ruler.samples=2"], tmp)  # fmt: skip
    return tmp / "outputs" / "train" / "r"


@pytest.mark.slow
def test_the_callback_logs_the_suite_and_its_wandb_table(trained_run):
    report = json.loads((trained_run / "eval" / "ruler_step2.json").read_text())
    assert report["instance_seed"] == 0 and len(report["cells"]) == 2 * 2 * 2
    logged = pd.read_csv(trained_run / "csv" / "metrics.csv")
    for row in report["lengths"]:
        column = logged[f"val/ruler/{row['task']}/{row['length']}"].dropna()
        assert len(column) == 2 and column.iloc[-1] == pytest.approx(row["score"])
    # no RULER task, so no RULER effective length; the relative one, anchored at seq_len 256
    relative = report["effective_length"]["relative"]
    assert report["effective_length"]["ruler"] is None and "val/effective_length" not in logged
    assert relative["anchor"] == 256
    assert logged["val/effective_length_relative"].dropna().iloc[-1] == (relative["length"] or 0)
    results = pd.read_csv(trained_run / "eval" / "ruler_results.csv")
    assert sorted(results["step"].unique()) == [1, 2] and len(results) == 2 * 16

    # W&B's offline run keeps each logged table as a JSON file of its own (columns, data)
    (run,) = trained_run.glob("wandb/offline-run-*")
    files = sorted(run.glob("files/media/table/val/ruler_table_*.table.json"))
    tables = [pd.DataFrame(**_table(f)) for f in files]
    tables.sort(key=lambda t: int(t["step"].iloc[0]))
    assert [int(t["step"].iloc[0]) for t in tables] == [1, 2]
    expected = pd.DataFrame(report["cells"])
    keys = ["task", "length", "depth", "n"]
    assert tables[-1][keys].values.tolist() == expected[keys].values.tolist()
    assert np.allclose(tables[-1]["score"], expected["score"])
    assert np.allclose(tables[-1]["ci_high"], expected["ci_high"])


def _table(path) -> dict:
    data = json.loads(path.read_text())
    return {"data": data["data"], "columns": data["columns"]}


@pytest.mark.slow
def test_an_export_scores_as_the_run_it_came_from(trained_run, tmp_path):
    from longctx.eval.ruler.hf import load_hf_folder
    from longctx.hf.export import export

    ckpt = trained_run / "checkpoints" / "last.ckpt"
    hf = export(ckpt, tmp_path / "hf").folder  # max_position_embeddings: the trained 256
    common = ["--suite", "ruler", "--tasks", "lc_passkey,lc_niah_single,lc_copy", "--lengths", "200",
              "--depths", "0", "1", "--samples", "3", "--cache-dir", str(CACHE_DIR)]  # fmt: skip
    ours = cli.main([str(ckpt), "--out", str(tmp_path / "ours"), *common])
    theirs = cli.main(["--hf", str(hf), "--out", str(tmp_path / "theirs"), *common])
    assert ours["instances_sha256"] == theirs["instances_sha256"]  # the same token ids
    a = pd.read_csv(tmp_path / "ours" / "ruler_results.csv")
    b = pd.read_csv(tmp_path / "theirs" / "ruler_results.csv")
    pd.testing.assert_frame_equal(a, b)
    assert a["token_accuracy"].between(0, 1).all()

    stored = read_stored_run(ckpt, CONFIG_TARGETS)
    model_config, _ = cli.load_configs(stored, None, None, None)
    model = cli.load_model(stored, model_config, "cpu")
    scorer, _, _ = load_hf_folder(hf)
    batch = instance_batch(make_instances(TOK, ["lc_copy"], [200], [0.5], 2, haystack="noise"))
    with torch.no_grad():
        expected = answer_logits(model, batch)
        assert_close_scaled(answer_logits(scorer, batch), expected)
        assert_close_scaled(plain_transformers_logits(scorer, batch), expected)


def plain_transformers_logits(scorer, batch):
    """The logits the scorer's transformers model computes by itself, at the labelled positions."""
    logits = scorer.hf_model(
        input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False
    ).logits
    return logits[batch.labels != IGNORE_INDEX]


@pytest.mark.slow
def test_the_command_line_refuses_lengths_past_rope_and_unknown_tasks(trained_run, capsys):
    ckpt = str(trained_run / "checkpoints" / "last.ckpt")
    with pytest.raises(SystemExit):
        cli.cli([ckpt, "--suite", "ruler", "--lengths", "200000"])
    assert "error: evaluation length 200000 (--lengths) exceeds model.max_seq_len" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        cli.cli([ckpt, "--suite", "ruler", "--tasks", "lc_passkey,bogus"])
    assert "error: unknown task ('bogus')" in capsys.readouterr().err
