"""An export of a run trained with data.tokenizer=llama3 carries Llama 3's tokenizer: transformers
5 (here) and 4.57 (.venv-tf4) encode every text as the reference does, specials by id only, with
Llama 3's BOS/EOS ids; the logits equal longctx's; `longctx.hf.verify` passes and lm-eval scores
it with longctx's own bits per byte."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from export_helpers import longctx_model, make_run, model_overrides
from helpers import CACHE_DIR, ROOT, SCRIPTS

from longctx.batch import PackedBatch
from longctx.data.corpus import default_corpus_dir
from longctx.data.tokenizer import Llama3Tokenizer
from longctx.hf.export import export
from longctx.hf.verify import verify

pytestmark = pytest.mark.slow
TEXTS = ["In the beginning God created", "a<|begin_of_text|>b<|eot_id|>c", "ünïcödé 🙂\t中文",
         "  12345 spaces , and .punctuation\n\n"]  # fmt: skip
TF4 = Path(os.environ.get("LONGCTX_TF4_VENV", ROOT / ".venv-tf4")) / "bin" / "python"


@pytest.fixture(scope="module")
def llama3_export(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("llama3")
    run = make_run(root, [*model_overrides(None, vocab_size=128256), "data.tokenizer=llama3"])
    return run, export(run, root / "hf").folder  # no --tokenizer: the run's data.tokenizer


def test_a_run_on_llama3_prepared_shards_exports_llama3s_tokenizer(tmp_path):
    """data=shards on a folder prepared with --tokenizer llama3, data.tokenizer unset: the export
    once carried the 259-id byte tokenizer (the run's tokenizer was read from data.tokenizer,
    not from the manifest)."""
    shards = default_corpus_dir(CACHE_DIR, tokenizer="llama3")  # prepared with --tokenizer llama3
    overrides = [
        *model_overrides(None, vocab_size=128256),
        "data=shards",
        f"data.shards=[{shards}]",
    ]
    folder = export(make_run(tmp_path, overrides), tmp_path / "hf").folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 128256 and tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer(TEXTS[0])["input_ids"] == reference_ids(TEXTS[0])


def reference_ids(text: str) -> list[int]:
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer(Llama3Tokenizer().model_file).encode(text, bos=False, eos=False)


def test_the_export_carries_llama3s_tokenizer(llama3_export):
    run, folder = llama3_export
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 128256
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (128000, 128001)
    assert tokenizer.convert_tokens_to_ids("<|eot_id|>") == 128009
    for text in TEXTS:
        expected = reference_ids(text)
        assert tokenizer(text)["input_ids"] == expected == tokenizer.encode(text), text
        assert tokenizer.decode(expected) == text
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (128000, 128001)
    ids = reference_ids(TEXTS[0] + " " + TEXTS[2])
    tokens = torch.tensor([[128000, *ids]])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    batch = PackedBatch.from_lengths(tokens, [[tokens.shape[1]]], reset_position_ids=True)
    with torch.no_grad():
        ours, theirs = longctx_model(run)(batch), model(input_ids=tokens).logits
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


@pytest.mark.skipif(not TF4.is_file(), reason="no .venv-tf4: bash scripts/setup_tf4_venv.sh")
def test_transformers_4_gives_the_same_ids(llama3_export, tmp_path):
    run, folder = llama3_export
    tokens = torch.randint(0, 128256, (1, 40), generator=torch.Generator().manual_seed(3))
    batch = PackedBatch.from_lengths(tokens, [[40]], reset_position_ids=True)
    with torch.no_grad():
        torch.save(longctx_model(run)(batch)[0], tmp_path / "llama3.pt")
    record = json.loads((folder / "longctx_export.json").read_text())
    case = {"name": "llama3", "folder": str(folder), "texts": TEXTS,
            "ids": [reference_ids(t) for t in TEXTS], "tokens": tokens[0].tolist(),
            "logits": str(tmp_path / "llama3.pt"),
            "max_position_embeddings": record["max_position_embeddings"]}  # fmt: skip
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of longctx
    proc = subprocess.run(
        [str(TF4), str(SCRIPTS / "export_tf4_check.py"), str(tmp_path / "cases.json")],
        capture_output=True, text=True, timeout=900, env={**env, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["transformers"].startswith("4.")
    assert result["problems"] == {"llama3": []}


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="pip install '.[eval]'")
def test_verify_passes_and_lm_eval_scores_it(llama3_export):
    _, folder = llama3_export
    result = verify(folder, documents=2)  # the llama3-prepared embedded corpus's val split
    assert result.max_diff <= 1e-5 * result.max_logit
    assert result.bpb_lm_eval == pytest.approx(result.bpb_longctx_rolling, rel=1e-5)
    assert 0 < result.bpb_lm_eval < 100
