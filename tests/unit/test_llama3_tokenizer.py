"""Llama 3's tokenizer (`--tokenizer llama3`) gives the reference's ids: those of
``llama_models.llama3.tokenizer.Tokenizer.encode(s, bos=False, eos=False)`` (tiktoken with the
package's own ranks and pattern), on the whole embedded corpus, on generated unicode and on the
literal text of every special token, which stays text. Its Hugging Face fast tokenizer (what an
export carries) gives the same ids. Nothing is downloaded: the ranks ship in llama-models."""

from __future__ import annotations

import functools
import importlib.util
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longctx.data.corpus import HELD_OUT_BOOKS, books, chapters, kjv_source_path
from longctx.data.prepare import cli as prepare_cli
from longctx.data.prepare import prepare
from longctx.data.shards import ShardSet
from longctx.data.tokenizer import (
    LLAMA3_SPECIALS,
    Llama3Tokenizer,
    MissingExtra,
    load_tokenizer,
)


@functools.cache
def ours() -> Llama3Tokenizer:
    return load_tokenizer("llama3")


@functools.cache
def reference():
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer(ours().model_file)  # a Path, as the reference requires


def reference_ids(text: str) -> list[int]:
    return reference().encode(text, bos=False, eos=False)


def fast_ids(text: str) -> list[int]:
    return ours().fast_tokenizer().encode(text, add_special_tokens=False).ids


# --------------------------------------------------------------------------- generated unicode
EMOJI = ["😀", "👩‍👩‍👧", "🇫🇷", "❤️", "🧑🏽‍💻"]
CJK = ["中文", "日本語のテキスト", "한국어", "漢字かな交じり文"]
COMBINING = ["e\u0301", "a\u0308\u0304", "\u0915\u094d\u0937", "n\u0303o"]
WHITESPACE = [" " * 40, "\n\n\n", "\t \t", " \r\n ", "\u00a0\u2003", " " * 3 + "\n" + " " * 7]
DIGITS = ["0", "123", "1234567", "3.14159", "1,000,000", "٣٤٥"]
SPECIAL_TEXT = [*LLAMA3_SPECIALS[:12], "<|", "|>", "<|reserved_special_token_250|>"]
FRAGMENTS = EMOJI + CJK + COMBINING + WHITESPACE + DIGITS + SPECIAL_TEXT + ["'s", "'LL", "don't"]
texts = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(FRAGMENTS)), max_size=16).map(
    "".join
)


@settings(max_examples=400, deadline=None)
@given(text=texts)
def test_ids_equal_the_references_on_generated_unicode(text):
    ids = ours().encode(text)
    assert ids.dtype == np.int64
    assert ids.tolist() == reference_ids(text)
    assert fast_ids(text) == ids.tolist()
    assert ours().decode(ids) == text  # decode round-trips


@settings(max_examples=30, deadline=None)
@given(run=st.sampled_from([" ", "a", "\n", "7"]), length=st.integers(24_990, 25_020))
def test_long_runs_are_split_where_the_reference_splits_them(run, length):
    # the reference encodes runs of 25k characters apart (a tiktoken stack limit); so does
    # encode, so a prepared corpus holds the reference's ids however long its runs
    text = "x " + run * length + " y"
    assert ours().encode(text).tolist() == reference_ids(text)


def test_special_token_text_is_text_and_ids_are_llama3s():
    tok = ours()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eot_id) == (128256, 128000, 128001, 128009)
    fast = tok.fast_tokenizer()
    assert fast.get_vocab_size(with_added_tokens=True) == 128256
    for i, special in enumerate(LLAMA3_SPECIALS):
        assert fast.token_to_id(special) == 128000 + i  # all 256 specials, by id
        assert tok.decode([128000 + i]) == special
        for text in (special, f"a{special}b", f" {special}\n"):
            ids = tok.encode(text).tolist()
            assert ids == reference_ids(text) == fast_ids(text)
            assert max(ids) < 128000, f"{text!r} became a special id"


def test_the_fast_tokenizer_saves_and_reloads_with_the_same_ids(tmp_path):
    import tokenizers

    path = tmp_path / "tokenizer.json"
    ours().fast_tokenizer().save(str(path))
    loaded = tokenizers.Tokenizer.from_file(str(path))
    loaded.encode_special_tokens = True  # longctx's reading: specials by id only
    text = "In the beginning<|end_of_text|> 😀 中文 1234567"
    assert loaded.encode(text, add_special_tokens=False).ids == reference_ids(text)
    assert json.loads(path.read_text())["model"]["type"] == "BPE"


@pytest.mark.slow
def test_ids_equal_the_references_on_the_whole_embedded_corpus():
    """Every chapter and every held-out book (1,189 chapters, 4.2 M characters, about a million
    tokens): tiktoken encode, the reference and the fast tokenizer give the same ids."""
    source = kjv_source_path()
    documents = [r["text"] for r in chapters(source)]
    documents += [r["text"] for r in books(source, HELD_OUT_BOOKS)]
    fast = [
        e.ids for e in ours().fast_tokenizer().encode_batch(documents, add_special_tokens=False)
    ]
    total = 0
    for text, fast_doc in zip(documents, fast, strict=True):
        ids = ours().encode(text).tolist()
        assert ids == reference_ids(text) == fast_doc, text[:40]
        total += len(ids)
    assert total > 1_000_000


def test_a_lone_surrogate_gets_the_references_ids():
    # JSON can spell one ("\\ud800"); tiktoken replaces it (U+FFFD), the reference with it
    for text in ("a\ud800b", "\udc80", "x " * 13_000 + "\ud800 y"):
        assert ours().encode(text).tolist() == reference_ids(text)


def test_prepared_shards_hold_the_references_ids_in_input_order(tmp_path):
    """`prepare --tokenizer llama3` writes, per document, the reference's ids and EOS (uint32),
    whatever the task count: special-token text, a lone surrogate, runs the reference splits."""
    texts = ["In the beginning", "z" * 25_001 + " don't", "<|end_of_text|> is text", "a\ud800b",
             "中文 😀 1234567", "x " + " " * 25_010 + "y", "", "\n\n\r\n"]  # fmt: skip
    source = tmp_path / "docs.jsonl"
    source.write_text(
        "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
    )
    for tasks in (1, 3):
        out = tmp_path / f"out{tasks}"
        manifest = prepare([source], out, "llama3", tasks=tasks, workers=1, val_fraction=0.0,
                           shard_tokens=3_000, progress=False)  # fmt: skip
        shards = ShardSet(out)
        assert manifest.dtype == "uint32" and len(manifest.splits["train"].shards) > 1
        expected = [reference_ids(t) + [128001] for t in texts if t]  # an empty one is skipped
        assert [shards.document(i).tolist() for i in range(len(shards))] == expected


# --------------------------------------------------------------------------- refusals
def test_an_unknown_tokenizer_name_is_one_line(tmp_path, capsys):
    source = tmp_path / "a.txt"
    source.write_text("some text\n")
    with pytest.raises(SystemExit) as exit:
        prepare_cli([str(source), "--tokenizer", "llama4", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit.value.code == 2 and "\n" not in err
    assert err.startswith("error: tokenizer 'llama4'") and "'llama3'" in err
    assert not (tmp_path / "out").exists()


def test_without_the_extra_the_error_names_it(monkeypatch, tmp_path, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_models" else find_spec(name, *a),
    )
    with pytest.raises(MissingExtra, match=r"pip install -e '\.\[llama3\]'"):
        Llama3Tokenizer()
    source = tmp_path / "a.txt"
    source.write_text("some text\n")
    with pytest.raises(SystemExit):
        prepare_cli([str(source), "--tokenizer", "llama3", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "[llama3]" in err and err.startswith("error: ")
