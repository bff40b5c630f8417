"""python -m longctx.hf.export: a longctx run's checkpoint as a transformers folder that
AutoModelForCausalLM, AutoTokenizer, pipeline and generate open, with longctx's logits and
token ids; a sharded checkpoint exports the same; bad input is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from export_helpers import longctx_model, make_run, model_overrides
from safetensors.torch import load_file

from longctx.data.tokenizer import ByteTokenizer
from longctx.hf.export import cli, export, main

TEXT = "Packed documents,\n\ttabs and ünïcödé — 長い文脈 🙂 end.  "


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A run (YaRN x4 from 32, trained at 64) exported in shards; (run, export folder)."""
    root = tmp_path_factory.mktemp("export")
    run = make_run(root)
    done = export(run / "checkpoints" / "last.ckpt", root / "hf", max_shard_size="40KB")
    return run, done.folder


def test_export_opens_in_transformers_with_the_same_logits(exported):
    run, out = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with its index
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_theta"] == 500000.0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert theirs.config.rope_parameters["factor"] == 4.0
    tokens = torch.randint(0, 259, (1, 100), generator=torch.Generator().manual_seed(1))
    ours = longctx_model(run)
    from longctx.batch import PackedBatch

    batch = PackedBatch.from_lengths(tokens, [[100]], reset_position_ids=True)
    with torch.no_grad():  # 100 positions: beyond YaRN's original 32
        expected = theirs(input_ids=tokens, position_ids=batch.position_ids).logits
        torch.testing.assert_close(
            ours(batch), expected, rtol=0, atol=1e-5 * float(expected.abs().max())
        )


def test_export_states_its_lengths_and_special_ids(exported):
    _, out = exported
    config = json.loads((out / "config.json").read_text())
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    # YaRN from 32 by 4 reaches 128, beyond the 64 the run trained at
    assert config["max_position_embeddings"] == 128 == tokenizer_config["model_max_length"]
    ids = {"bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256}
    assert {k: config[k] for k in ids} == ids
    assert {k: generation[k] for k in ids} == ids
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_input_names"] == ["input_ids", "attention_mask"]
    record = json.loads((out / "longctx_export.json").read_text())
    assert (record["trained_length"], record["max_position_embeddings"]) == (64, 128)


def test_tokenizer_pipeline_and_generate(exported):
    _, out = exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    encoded = tokenizer(TEXT, return_tensors="pt")
    assert set(encoded) == {"input_ids", "attention_mask"}
    assert encoded["input_ids"][0].tolist() == ByteTokenizer().encode(TEXT).tolist()
    assert tokenizer.decode(encoded["input_ids"][0]) == TEXT
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    generated = model.generate(**encoded, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == encoded["input_ids"].shape[1] + 5
    assert (
        generated[0, : encoded["input_ids"].shape[1]].tolist() == encoded["input_ids"][0].tolist()
    )
    with torch.no_grad():  # greedy: each new token is the argmax after the ones before it
        logits = model(generated[:, :-1]).logits
    assert torch.equal(logits[0, -5:].argmax(-1), generated[0, -5:])
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    text = pipe("In the beginning", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("In the beginning")


def test_a_sharded_checkpoint_exports_the_same_as_a_ckpt(tmp_path):
    single = make_run(tmp_path / "a", seed=2)
    sharded = make_run(tmp_path / "b", seed=2, sharded=True)
    assert (sharded / "checkpoints" / "last.ckpt").is_dir()
    one = export(single / "checkpoints" / "last.ckpt", tmp_path / "one").folder
    two = export(sharded, tmp_path / "two").folder  # the run folder: its last.ckpt
    a, b = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (one / name).read_text() == (two / name).read_text(), name


# --------------------------------------------------------------------------- bad input
def test_refuses_a_vocabulary_smaller_than_the_byte_tokenizer(tmp_path):
    run = make_run(tmp_path, model_overrides(vocab_size=200))
    with pytest.raises(ValueError, match="has 259 ids .*more than the model's vocab_size=200"):
        export(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refuses_a_non_empty_folder(tmp_path, capsys):
    run = make_run(tmp_path)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        cli([str(run), "--out", str(tmp_path / "taken")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --out ") and "taken exists and is not empty" in err
    assert len(err.splitlines()) == 1  # one line, no traceback
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_the_config_comes_from_the_checkpoints_record_and_is_data(tmp_path, capsys):
    """No .hydra/config.yaml is read; a record naming other code than longctx's config classes
    is refused, naming the file and key, before anything is built."""
    run = make_run(tmp_path, model_overrides(None) + ["model.rope_theta=10000"])
    assert not (run / ".hydra").exists()
    out = export(run, tmp_path / "hf").folder
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 10000.0
    ckpt = run / "checkpoints" / "last.ckpt"
    contents = torch.load(ckpt, weights_only=True)
    contents["longctx_run"]["config"]["model"] = {
        "_target_": "torch.load",
        "f": str(tmp_path / "evil.pkl"),
        "weights_only": False,
    }
    torch.save(contents, ckpt)
    with pytest.raises(SystemExit) as exit_info:
        cli([str(run), "--out", str(tmp_path / "hf2")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert str(ckpt) in err and "model._target_='torch.load' is not one of longctx's" in err
    del contents["longctx_run"]
    torch.save(contents, ckpt)
    with pytest.raises(ValueError, match="holds no run config"):
        export(ckpt, tmp_path / "hf3")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".hf", "hf2", "hf3"))]


def test_export_prints_what_it_wrote_and_the_next_command(tmp_path, capsys):
    run = make_run(tmp_path)
    main([str(run), "--out", str(tmp_path / "hf")])
    out = capsys.readouterr().out
    assert f"to {tmp_path / 'hf'}" in out and "max_position_embeddings=128" in out
    assert f"next: python -m longctx.hf.verify {tmp_path / 'hf'}" in out
    assert "\r" not in out  # no progress bar off a terminal
