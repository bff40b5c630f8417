"""Llama 3's fast tokenizer (what an export carries) is cached once per machine; the cache is
used only while its content has the digest recorded when it was built. A cached tokenizer.json
with two ids swapped (or without a digest) is rebuilt from the model file, never used."""

from __future__ import annotations

import json

from longctx.data.tokenizer import (
    Llama3Tokenizer,
    _digest_file,
    _llama3_cache_file,
    _llama3_fast_tokenizer,
    _sha256_text,
)

TEXT = "the cat and the dog"


def test_a_tampered_cache_is_rebuilt_not_used(tmp_path, monkeypatch, capsys):
    tok = Llama3Tokenizer()
    good = tok.fast_tokenizer().to_str()  # this session's (built or read once)
    expected = tok.encode(TEXT).tolist()
    monkeypatch.setenv("LONGCTX_CACHE", str(tmp_path))
    cached = _llama3_cache_file(tok.model_file)
    assert cached.is_relative_to(tmp_path)
    tampered = json.loads(good)
    vocab = tampered["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    cached.write_text(json.dumps(tampered))
    _digest_file(cached).write_text(_sha256_text(good))  # the digest of what was built
    _llama3_fast_tokenizer.cache_clear()
    try:
        ids = tok.fast_tokenizer().encode(TEXT, add_special_tokens=False).ids
        assert ids == expected  # the swapped cache once gave other ids (and an export carried them)
        assert "differs from what was built" in capsys.readouterr().err
        assert _sha256_text(cached.read_text()) == _digest_file(cached).read_text()
        _llama3_fast_tokenizer.cache_clear()  # the rebuilt cache is used as it is
        assert tok.fast_tokenizer().encode(TEXT, add_special_tokens=False).ids == expected
        assert "differs" not in capsys.readouterr().err
    finally:
        _llama3_fast_tokenizer.cache_clear()
