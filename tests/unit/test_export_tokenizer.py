"""The export's tokenizer encodes every string exactly as prepare did: the byte tokenizer gives
longctx's ByteTokenizer ids for any text (literal <s>, </s>, <pad> included), specials are
reachable only by id, and `prepare --tokenizer <export>` writes the same shards as
`--tokenizer byte`. A user's own tokenizer exports with prepare's encoding too."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from export_helpers import make_user_run, make_user_tokenizer, model_overrides
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.data.prepare import prepare
from longctx.data.tokenizer import ByteTokenizer, HFTokenizer
from longctx.hf.export import cli, export
from longctx.hf.export_tokenizer import write_byte_tokenizer

LITERALS = ["<s>", "</s>", "<pad>", "<", "s>", "</", "pad>", "<|endoftext|>"]
# characters whose UTF-8 looks like broken sequences when read as Latin-1, and control bytes
ODD = ["\xc3\x28", "\xed\xa0\x80", "\xf0\x28\x8c\xbc", "\x00", "\x7f", "\x80", "\ufffd", "\ufeff"]
texts = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(LITERALS + ODD)), max_size=12).map(
    "".join
)


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory) -> tuple[Path, object]:
    """The byte tokenizer's files as an export writes them (no model needed for encoding), and
    transformers' AutoTokenizer on them."""
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder, model_max_length=2048)
    return folder, transformers.AutoTokenizer.from_pretrained(folder)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_the_exported_byte_tokenizer_encodes_any_text_as_longctx(byte_export, text):
    folder, tokenizer = byte_export
    expected = ByteTokenizer().encode(text).tolist()
    assert tokenizer(text)["input_ids"] == expected
    assert tokenizer.encode(text) == expected  # lm-eval's call
    assert tokenizer.decode(expected) == text
    # prepare's reading of the same folder
    assert HFTokenizer(folder).encode(text).tolist() == expected


def test_specials_are_reachable_only_by_id(byte_export):
    _, tokenizer = byte_export
    assert tokenizer("a<s>b</s>c<pad>")["input_ids"] == list(b"a<s>b</s>c<pad>")
    assert tokenizer("x", add_special_tokens=True)["input_ids"] == [ord("x")]  # nothing added
    specials = {"<pad>": 256, "<s>": 257, "</s>": 258}
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in specials} == specials
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        256,
        257,
        258,
    )
    assert tokenizer.decode([97, 257, 98, 258]) == "a<s>b</s>"
    assert tokenizer.decode([97, 257, 98, 258], skip_special_tokens=True) == "ab"
    for b in range(256):  # every byte, alone and inside text
        char = bytes([b]).decode("latin-1")
        assert tokenizer(char)["input_ids"] == list(char.encode()), b


def test_a_lone_surrogate_is_refused_by_both(byte_export):
    with pytest.raises(UnicodeEncodeError):
        ByteTokenizer().encode("a\udc80")
    with pytest.raises((TypeError, UnicodeEncodeError)):
        byte_export[1]("a\udc80")


def test_prepare_with_the_export_writes_the_byte_shards(tmp_path, byte_export):
    docs = [
        "plain text",
        "a<s>b</s>c<pad>d",
        "</s>",
        "<s>starts and ends</s>",
        "ünï <|endoftext|> 🙂 \x00",
    ]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": t, "id": str(i)}) + "\n" for i, t in enumerate(docs))
    )
    byte = tmp_path / "byte"
    ours = tmp_path / "export"
    prepare([jsonl], byte, "byte", workers=1, val_fraction=0.0, progress=False)
    prepare([jsonl], ours, byte_export[0], workers=1, val_fraction=0.0, progress=False)
    shards = sorted(p.name for p in byte.glob("*.npy"))
    assert shards and shards == sorted(p.name for p in ours.glob("*.npy"))
    for name in shards:
        assert (byte / name).read_bytes() == (ours / name).read_bytes(), name
    manifest = json.loads((ours / "manifest.json").read_text())
    assert (manifest["eos_id"], manifest["pad_id"], manifest["vocab_size"]) == (258, 256, 259)


# --------------------------------------------------------------------------- a user's tokenizer
@pytest.fixture(scope="module")
def user_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    source = make_user_tokenizer(root / "tok")
    run = make_user_run(root, source, model_overrides(vocab_size=300))
    return source, export(run, root / "hf").folder  # the data's tokenizer: the user's


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_a_user_tokenizer_exports_with_prepares_encoding(user_export, text):
    source, out = user_export
    expected = HFTokenizer(source).encode(text).tolist()  # what prepare wrote
    tokenizer = _auto(out)
    assert tokenizer(text)["input_ids"] == expected  # no <s> prepended, specials as text
    assert HFTokenizer(out).encode(text).tolist() == expected


@functools.cache
def _auto(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_a_user_tokenizer_export_generates_and_states_its_ids(user_export):
    source, out = user_export
    tokenizer = _auto(out)
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    hf = HFTokenizer(source)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    expected = {"bos_token_id": bos, "eos_token_id": hf.eos_id, "pad_token_id": hf.pad_id}
    assert {k: config[k] for k in expected} == expected == {k: generation[k] for k in expected}
    assert tokenizer("a</s>b")["input_ids"] == hf.encode("a</s>b").tolist()
    assert hf.eos_id not in tokenizer("a</s>b")["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    encoded = tokenizer("In the beginning", return_tensors="pt")
    generated = model.generate(**encoded, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == encoded["input_ids"].shape[1] + 3
    with torch.no_grad():
        logits = model(generated[:, :-1]).logits
    assert torch.equal(logits[0, -3:].argmax(-1), generated[0, -3:])


def test_a_user_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    source = make_user_tokenizer(tmp_path / "tok", vocab_size=400)
    run = make_user_run(tmp_path, source, model_overrides(vocab_size=300))
    with pytest.raises(SystemExit) as exit_info:
        cli([str(run), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    size = HFTokenizer(source).vocab_size
    assert err.startswith(f"error: the tokenizer {source} ") and f"has {size} ids" in err
    assert "vocab_size=300" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "hf").exists()
