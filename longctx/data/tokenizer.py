"""Tokenizers: a small protocol, a byte-level tokenizer, and local Hugging Face tokenizers.

Nothing here downloads: a Hugging Face tokenizer comes from a local folder only.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...
    def decode(self, ids) -> str: ...

    @property
    def spec(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus pad, bos and eos: 259 ids, so it fits the `tiny` preset (512).

    Every text is its UTF-8 bytes, a literal ``<s>`` included: the special ids 256-258 are
    reachable only by id."""

    PAD, BOS, EOS = 256, 257, 258

    vocab_size = 259
    pad_id = PAD
    bos_id = BOS
    eos_id = EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    @property
    def spec(self) -> dict[str, Any]:
        return {"kind": "byte", "vocab_size": self.vocab_size}


# EOS candidates, in order, for a tokenizer.json without a tokenizer_config.json that names one.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local folder (its tokenizer.json), never downloaded.

    EOS comes from tokenizer_config.json's ``eos_token`` (or a common EOS name); pad is the
    config's ``pad_token`` or, when there is none, EOS (pad positions never carry loss).

    A special token's text inside a document is text: ``encode`` never turns a literal
    ``</s>`` into the EOS id (which would end the document where the text merely quotes it),
    and adds no specials around the text. Special ids come only from the pipeline (the EOS
    prepare appends) -- the convention of the byte tokenizer, whose bytes are always bytes.
    """

    # in the spec: a folder prepared before this rule may hold other ids for the same text
    SPECIALS_IN_TEXT = "text"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser().resolve()
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"tokenizer folder {str(folder)!r} does not exist; expected 'byte' or a local "
                "folder with a tokenizer.json (nothing is downloaded)"
            )
        self._tok = _load_fast_tokenizer(self.folder)
        self._tok.encode_special_tokens = True  # not stored in tokenizer.json: set on each load
        config = _read_tokenizer_config(self.folder)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = self._special_id(config.get("eos_token"), _EOS_CANDIDATES, "EOS")
        pad = config.get("pad_token")
        self.pad_id = self._special_id(pad, (), "pad") if pad else self.eos_id

    def _special_id(self, token, candidates, what: str) -> int:
        if isinstance(token, dict):  # AddedToken serialised as a dict
            token = token.get("content")
        for name in ([token] if token else []) + list(candidates):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ValueError(
            f"tokenizer in {self.folder} has no {what} token (looked for {token or candidates}); "
            "expected tokenizer_config.json to name one that is in the vocabulary"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "path": str(self.folder),
            "sha256": _folder_sha256(self.folder),
            "vocab_size": self.vocab_size,
            "specials_in_text": self.SPECIALS_IN_TEXT,
        }

    def __getstate__(self):  # worker processes reload from the folder
        return {"folder": str(self.folder)}

    def __setstate__(self, state):
        self.__init__(state["folder"])


def load_tokenizer(spec: str | dict | Tokenizer) -> Tokenizer:
    """ "byte", a local tokenizer folder, a manifest spec dict, or a Tokenizer (returned as is)."""
    if isinstance(spec, dict):
        if spec.get("kind") == "byte":
            return ByteTokenizer()
        if spec.get("kind") == "hf":
            return HFTokenizer(spec["path"])
        raise ValueError(f"tokenizer spec {spec!r} has unknown kind; expected 'byte' or 'hf'")
    if isinstance(spec, str | Path):
        return ByteTokenizer() if str(spec) == "byte" else HFTokenizer(spec)
    if isinstance(spec, Tokenizer):
        return spec
    raise TypeError(f"tokenizer {spec!r}; expected 'byte', a folder path, or a Tokenizer")


def _load_fast_tokenizer(folder: Path):
    import tokenizers

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer folder {folder} has no tokenizer.json; expected a Hugging Face fast "
            "tokenizer saved with save_pretrained() or tokenizers.Tokenizer.save()"
        )
    return tokenizers.Tokenizer.from_file(str(path))


def _read_tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _folder_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
