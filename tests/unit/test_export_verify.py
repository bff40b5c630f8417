"""--verify: transformers' logits on held-out documents against longctx's, a nonzero exit naming
the max difference beyond the tolerance, and lm-eval's local perplexity task giving longctx's
bits per byte (skipped with a reason where lm-eval is not installed)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from export_helpers import make_run
from safetensors.torch import load_file, save_file

from longctx.hf.export import export
from longctx.hf.verify import TASK_NAME, cli, verify


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    return export(make_run(root), root / "hf").folder


def test_verify_compares_logits_on_held_out_documents(exported, capsys):
    result = verify(exported, documents=3)
    assert result.documents == 3 and result.max_diff <= 1e-5 * result.max_logit
    out = capsys.readouterr().out
    assert "logits on 3 held-out documents: max |diff|" in out
    assert f"--tasks {TASK_NAME} --include_path {exported / 'lm_eval'}" in out
    task = (exported / "lm_eval" / f"{TASK_NAME}.yaml").read_text()
    assert "output_type: loglikelihood_rolling" in task
    docs = (exported / "lm_eval" / "heldout.jsonl").read_text().splitlines()
    assert len(docs) == 3 and all(json.loads(d)["text"] for d in docs)
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
