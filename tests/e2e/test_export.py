"""python -m longctx.hf.export: a longctx run's checkpoint as a transformers folder that
AutoModelForCausalLM and AutoTokenizer open, with longctx's logits and token ids."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
import transformers
from helpers import compose
from module_fixtures import SMALL, fit, random_batch
from omegaconf import OmegaConf

from longctx.data.tokenizer import ByteTokenizer
from longctx.hf.export import export, main
from longctx.model import LlamaConfig
from longctx.train.init_from import InitFromError
from longctx.train.module import LongCtxModule

# module_fixtures.SMALL with room for the byte tokenizer's 259 ids
SHAPES = {**SMALL, "vocab_size": 300}
# the same through the app's model group, with YaRN on top
MODEL_OVERRIDES = [
    "model=tiny",
    *(f"+model.{k}={v}" for k, v in SHAPES.items() if k != "attn_backend"),
    "model.rope_scaling={type: yarn, factor: 4, original_max_position: 32}",
]
TEXT = "Packed documents,\n\ttabs and ünïcödé — 長い文脈 🙂 end.  "


def make_run(tmp_path):
    """A run folder as train.py leaves it: .hydra/config.yaml and checkpoints/last.ckpt."""
    run = tmp_path / "run"
    cfg = compose(MODEL_OVERRIDES, output_dir=run)
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    torch.manual_seed(5)
    config = LlamaConfig.from_name("tiny", **SHAPES)  # trained without YaRN; exported with it
    module = LongCtxModule(config, optimizer=partial(torch.optim.SGD, lr=0.1), scheduler=None)
    trainer = fit(module, [random_batch(0, [[64]], 64)], max_steps=1, default_root_dir=tmp_path)
    trainer.save_checkpoint(run / "checkpoints" / "last.ckpt")
    return run, module


def longctx_logits(run, batch):
    from longctx.hf.export import _read, run_config_of

    model = _read(run, run_config_of(run))
    with torch.no_grad():
        return model.eval()(batch)


def test_export_opens_in_transformers_with_the_same_logits_and_tokens(tmp_path):
    run, _ = make_run(tmp_path)
    out = export(run / "checkpoints" / "last.ckpt", tmp_path / "hf", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with its index
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_theta"] == 500000.0

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.rope_parameters["factor"] == 4.0
    batch = random_batch(1, [[100]], 100, reset=False)  # beyond the original 32 positions
    ours = longctx_logits(run, batch)
    with torch.no_grad():
        expected = theirs(input_ids=batch.tokens, position_ids=batch.position_ids).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == ByteTokenizer().encode(TEXT).tolist()
    assert tokenizer.decode(ids) == TEXT
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        ByteTokenizer.PAD,
        ByteTokenizer.BOS,
        ByteTokenizer.EOS,
    )
    assert theirs.config.eos_token_id == ByteTokenizer.EOS


def test_every_byte_round_trips():
    from longctx.hf.export import byte_tokenizer_fast

    tokenizer = byte_tokenizer_fast()
    for b in range(256):
        char = bytes([b]).decode("latin-1")  # one or two UTF-8 bytes
        assert tokenizer(char)["input_ids"] == list(char.encode()), b
    text = bytes(range(32, 127)).decode() + "".join(map(chr, range(0xA0, 0x200)))
    assert tokenizer(text)["input_ids"] == ByteTokenizer().encode(text).tolist()


def test_export_refuses_a_vocabulary_smaller_than_the_byte_tokenizer(tmp_path):
    run, _ = make_run(tmp_path)
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    saved.model.vocab_size = 200
    OmegaConf.save(saved, run / ".hydra" / "config.yaml")
    with pytest.raises(ValueError, match="259 ids do not fit the model's vocab_size=200"):
        export(run, tmp_path / "out")


def test_export_refuses_a_non_empty_folder_and_runs_without_config(tmp_path):
    run, _ = make_run(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="taken exists and is not empty"):
        main([str(run), "--out", str(tmp_path / "taken")])
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    alone = tmp_path / "alone.ckpt"
    (run / "checkpoints" / "last.ckpt").rename(alone)
    with pytest.raises(InitFromError, match="no .*config.yaml to read the model config from"):
        export(alone, tmp_path / "out")
    assert not (tmp_path / "out").exists()
