"""--verify: transformers' logits on held-out documents against longctx's, a nonzero exit naming
the max difference beyond the tolerance, and lm-eval's local perplexity task giving longctx's
bits per byte (skipped with a reason where lm-eval is not installed)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from export_helpers import make_run
from safetensors.torch import load_file, save_file

from longctx.hf.export import export
from longctx.hf.verify import TASK_NAME, cli, verify, write_lm_eval_task


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    return export(make_run(root), root / "hf").folder


def test_verify_compares_logits_on_held_out_documents(exported, capsys, monkeypatch):
    monkeypatch.setattr("longctx.hf.verify.lm_eval_installed", lambda: False)
    result = verify(exported, documents=3)
    assert result.documents == 3 and result.max_diff <= 1e-5 * result.max_logit
    out = capsys.readouterr().out
    assert "logits on 3 held-out documents: max |diff|" in out
    assert "tokenizer: the export's ids equal the run's on 3 held-out documents" in out
    assert not (exported / "lm_eval").exists()  # nothing written into the folder verified
    # without lm-eval, its task is kept where verify wrote it, outside the export, and named
    task_dir = Path(out.split("its task is in ")[1].split()[0])
    assert f"--tasks {TASK_NAME} --include_path {task_dir} " in out
    assert (task_dir / f"{TASK_NAME}.yaml").is_file() and not task_dir.is_relative_to(exported)
    shutil.rmtree(task_dir)
    # longctx's two conventions differ only in the first byte and the EOS, a few bits a document
    assert (
        0 < result.bpb_longctx_own < 12
        and abs(result.bpb_longctx_rolling - result.bpb_longctx_own) < 0.5
    )


def test_verify_beyond_tolerance_exits_naming_the_max_difference(tmp_path, capsys):
    out = export(make_run(tmp_path), tmp_path / "hf").folder
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5  # not the trained model
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit) as exit_info:
        cli([str(out), "--documents", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: the export's logits differ from longctx's by "
    )
    assert "tolerance 0.0001 x max |logit|" in err[0]


@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm-eval is not installed: pip install -e '.[eval]'",
)
def test_lm_evals_local_task_gives_longctx_bits_per_byte(exported):
    result = verify(exported, documents=3)
    # lm-eval scores what longctx's model scores under lm-eval's convention (BOS prefix, no
    # EOS), to fp32 round-off; its gap to longctx's own convention is the BOS/EOS difference
    assert result.bpb_lm_eval == pytest.approx(result.bpb_longctx_rolling, rel=1e-5)
    assert torch.isfinite(torch.tensor(result.bpb_lm_eval))


@pytest.mark.parametrize("shards", [None, ["embedded"]])
def test_verify_reads_held_out_documents_of_the_embedded_corpus_by_name(shards):
    """``data.shards=[embedded]`` is a name, not a folder: verify once read Path('embedded')."""
    from helpers import CACHE_DIR

    from longctx.data.config import DataConfig
    from longctx.hf.verify import heldout_documents

    held = heldout_documents(DataConfig(shards=shards, cache_dir=str(CACHE_DIR)), 2, 64)
    assert len(held.texts) == 2 and all(len(ids) > 0 for ids in held.ids)


def test_lm_evals_task_is_written_into_a_fresh_private_folder(tmp_path):
    task_dir = write_lm_eval_task(["one", "two", "three"])
    try:
        assert (
            task_dir.parent == Path(tempfile.gettempdir()) and task_dir.stat().st_mode & 0o077 == 0
        )
        assert sorted(p.name for p in task_dir.iterdir()) == ["heldout.jsonl", f"{TASK_NAME}.yaml"]
        assert "output_type: loglikelihood_rolling" in (task_dir / f"{TASK_NAME}.yaml").read_text()
        docs = (task_dir / "heldout.jsonl").read_text().splitlines()
        assert [json.loads(d)["text"] for d in docs] == ["one", "two", "three"]
        assert write_lm_eval_task(["x"]) != task_dir  # a new one every time
    finally:
        shutil.rmtree(task_dir)


PLANTED_TASK = f"""task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: heldout.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
process_docs: !function planted.process_docs
"""
PLANTED_CODE = """import pathlib
pathlib.Path({marker!r}).write_text("ran")


def process_docs(dataset):
    return dataset
"""


def test_verify_never_runs_code_from_the_folder_nor_writes_through_it(tmp_path):
    """A downloaded export with an lm_eval/ folder of its own: a second YAML declaring verify's
    task with a !function (whose Python would run on import), and heldout.jsonl a symlink to a
    file outside. verify once passed DIR/lm_eval to lm-eval and wrote through the link."""
    out = export(make_run(tmp_path), tmp_path / "hf").folder
    planted, outside, marker = out / "lm_eval", tmp_path / "outside.txt", tmp_path / "ran"
    planted.mkdir()
    # sorted before verify's own YAML: against the old include path, lm-eval loaded this one
    (planted / "aa_planted.yaml").write_text(PLANTED_TASK)
    (planted / "planted.py").write_text(PLANTED_CODE.format(marker=str(marker)))
    outside.write_text("the user's file\n")
    (planted / "heldout.jsonl").symlink_to(outside)
    before = _contents(out)
    verify(out, documents=2)
    assert outside.read_text() == "the user's file\n"  # not written through the link
    assert not marker.exists()  # the planted Python never ran
    assert _contents(out) == before  # nothing in the folder was written


def _contents(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def test_verify_fails_when_the_exports_tokenizer_gives_other_ids(tmp_path, capsys):
    """Two ids swapped in the export's tokenizer.json: the logits still agree (verify feeds the
    run's ids), so only comparing the ids shows it. verify once passed, printing bits per byte."""
    out = export(make_run(tmp_path), tmp_path / "hf").folder
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["e"], vocab["t"] = vocab["t"], vocab["e"]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(SystemExit) as exit_info:
        cli([str(out), "--documents", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "the export's tokenizer encodes held-out document 0 differently" in err[0]
    )
    assert f"[{ord('t')}" in err[0] or f"[{ord('e')}" in err[0]
