"""The tokenizer files of an export: longctx's byte tokenizer as a transformers fast tokenizer,
Llama 3's, or a user's own tokenizer folder (whichever the run's data was prepared with),
written so that transformers 4.x and 5.x encode every string exactly as ``prepare`` did.

Two rules hold for both:
- special tokens are reachable only by id: a literal ``<s>``, ``</s>`` or ``<pad>`` in a text
  is text (its bytes, or whatever the tokenizer's model makes of its characters). The
  specials are registered as special added tokens, and ``split_special_tokens: true`` in
  tokenizer_config.json turns off their matching in text; transformers 4.x and 5.x both
  read it (tokenizers' own ``encode_special_tokens``, which tokenizer.json does not store);
- nothing is added around a text: no BOS or EOS post-processor, as prepare adds none (it
  appends EOS itself, as a document boundary).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longctx.data.tokenizer import ByteTokenizer, HFTokenizer, Llama3Tokenizer
from longctx.errors import LongctxError
from longctx.hf.folders import read_config_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
BYTE_SPECIALS = {ByteTokenizer.PAD: "<pad>", ByteTokenizer.BOS: "<s>", ByteTokenizer.EOS: "</s>"}
# post-processors that add special tokens around a text (tokenizers' names)
_ADDING_POST_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def tokenizer_settings(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json keys every export carries: the class both transformers 4.x and 5.x
    load, no token_type_ids (4.x's default returns them and generate refuses them), specials as
    text, the model's length, and no 4.x clean-up that would drop spaces before punctuation."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_input_names": ["input_ids", "attention_mask"],
        "split_special_tokens": True,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def byte_tokenizer_json() -> dict[str, Any]:
    """ByteTokenizer as a tokenizers ``tokenizer.json``: id b for byte b (GPT-2's byte-to-
    character alphabet, a BPE with no merges, so every byte stays its own token), then the
    special tokens <pad> 256, <s> 257, </s> 258."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = [BYTE_SPECIALS[i] for i in sorted(BYTE_SPECIALS)]
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    if [tok.token_to_id(n) for n in names] != sorted(BYTE_SPECIALS):
        raise AssertionError("the byte tokenizer's special ids moved")  # a tokenizers change
    return json.loads(tok.to_str())


def write_byte_tokenizer(folder: Path, model_max_length: int) -> dict[str, int]:
    """The byte tokenizer's three files in ``folder``; returns its special ids."""
    config = {
        **tokenizer_settings(model_max_length),
        "bos_token": BYTE_SPECIALS[ByteTokenizer.BOS],
        "eos_token": BYTE_SPECIALS[ByteTokenizer.EOS],
        "pad_token": BYTE_SPECIALS[ByteTokenizer.PAD],
    }
    _write_files(folder, byte_tokenizer_json(), config, {k: config[k] for k in _SPECIAL_KEYS})
    return {
        "bos_token_id": ByteTokenizer.BOS,
        "eos_token_id": ByteTokenizer.EOS,
        "pad_token_id": ByteTokenizer.PAD,
    }


_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token")


def write_tokenizer(
    tokenizer: str | Path | None, folder: Path, model_max_length: int, vocab_size: int
) -> dict[str, int]:
    """The run's tokenizer in ``folder``: None or 'byte' (the bytes), 'llama3', or a folder
    (what ``prepare --tokenizer`` read); returns its special ids."""
    if tokenizer is None or str(tokenizer) == "byte":
        _check_fits("byte", ByteTokenizer.vocab_size, vocab_size)
        return write_byte_tokenizer(folder, model_max_length)
    if str(tokenizer) == Llama3Tokenizer.NAME:
        return write_llama3_tokenizer(folder, model_max_length, vocab_size)
    return write_user_tokenizer(Path(tokenizer), folder, model_max_length, vocab_size)


LLAMA3_SPECIAL_NAMES = {
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "pad_token": "<|finetune_right_pad_id|>",
}


def write_llama3_tokenizer(folder: Path, model_max_length: int, vocab_size: int) -> dict[str, int]:
    """Llama 3's fast tokenizer (longctx.data.tokenizer.Llama3Tokenizer) in ``folder``: its
    128,256 ids, specials by id only, nothing added around a text (lm-eval and a user add the
    BOS a Llama 3 document starts with, as this run's packing did by default)."""
    tok = Llama3Tokenizer()
    _check_fits(Llama3Tokenizer.NAME, tok.vocab_size, vocab_size)
    tokenizer_json = json.loads(tok.fast_tokenizer().to_str())
    tokenizer_json["post_processor"] = _without_adding(tokenizer_json.get("post_processor"))
    config = {**tokenizer_settings(model_max_length), **LLAMA3_SPECIAL_NAMES}
    _write_files(folder, tokenizer_json, config, dict(LLAMA3_SPECIAL_NAMES))
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def write_user_tokenizer(
    source: Path, folder: Path, model_max_length: int, vocab_size: int
) -> dict[str, int]:
    """A user's tokenizer folder (what ``prepare --tokenizer`` read) copied into ``folder``, with
    the export's settings and without a post-processor that adds specials; returns its special
    ids (bos only when its config names one). Refuses a vocabulary the model cannot hold."""
    tok = HFTokenizer(source)  # prepare's own reading: its EOS and pad are the run's
    _check_fits(source, tok.vocab_size, vocab_size)
    tokenizer_json = read_config_json(tok.folder, TOKENIZER_FILE)
    tokenizer_json["post_processor"] = _without_adding(tokenizer_json.get("post_processor"))
    has_config = (tok.folder / TOKENIZER_CONFIG).is_file()
    old_config = read_config_json(tok.folder, TOKENIZER_CONFIG) if has_config else {}
    config = {**old_config, **tokenizer_settings(model_max_length)}
    config.pop("auto_map", None)  # a custom class is code; the export's class is the fast one
    config.setdefault("eos_token", tok.decode([tok.eos_id]))
    config.setdefault("pad_token", tok.decode([tok.pad_id]))
    specials = {k: config[k] for k in (*_SPECIAL_KEYS, "unk_token") if config.get(k) is not None}
    _write_files(folder, tokenizer_json, config, specials)
    ids = {"eos_token_id": int(tok.eos_id), "pad_token_id": int(tok.pad_id)}
    bos = _token_id(tokenizer_json, config.get("bos_token"))
    if bos is not None:
        ids["bos_token_id"] = bos
    return ids


def _check_fits(name, ids: int, vocab_size: int) -> None:
    """Every id of the tokenizer must index the model's embedding (added tokens included)."""
    if ids > vocab_size:
        raise LongctxError(
            f"the tokenizer {name} has {ids} ids (added tokens included), more than the model's "
            f"vocab_size={vocab_size}; export a checkpoint trained on the data it prepared"
        )


def _write_files(folder: Path, tokenizer_json: dict, config: dict, specials: dict) -> None:
    write_json(folder / TOKENIZER_FILE, tokenizer_json)
    write_json(folder / TOKENIZER_CONFIG, config)
    write_json(folder / SPECIAL_TOKENS_MAP, specials)


def _without_adding(post: dict | None) -> dict | None:
    """``post`` minus the steps that add special tokens (prepare's encode adds none)."""
    if post is None or post.get("type") in _ADDING_POST_PROCESSORS:
        return None
    if post.get("type") == "Sequence":
        kept = [p for p in post["processors"] if p.get("type") not in _ADDING_POST_PROCESSORS]
        return {**post, "processors": kept} if kept else None
    return post


def _token_id(tokenizer_json: dict, token) -> int | None:
    if isinstance(token, dict):  # an AddedToken serialised as a dict
        token = token.get("content")
    if not token:
        return None
    for added in tokenizer_json.get("added_tokens", []):
        if added["content"] == token:
            return int(added["id"])
    vocab = tokenizer_json.get("model", {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte, as tokenizers' ByteLevel maps them: printable
    Latin-1 bytes stand for themselves, the others take code points from 256 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
