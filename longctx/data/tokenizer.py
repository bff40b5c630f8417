"""Tokenizers: a small protocol, a byte-level tokenizer, Llama 3's tokenizer, and local Hugging
Face tokenizers.

Nothing here downloads: a Hugging Face tokenizer comes from a local folder only, and Llama 3's
from the ``tokenizer.model`` that Meta's ``llama-models`` package ships (the ``llama3`` extra).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from longctx.data.cache import cache_root
from longctx.errors import LongctxError
from longctx.io import atomic_write_bytes


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
                f"tokenizer {str(folder)!r} does not exist (not a name or a folder); expected 'byte', 'llama3' "
                "or a local folder with a tokenizer.json (nothing is downloaded)"
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
        raise LongctxError(
            f"tokenizer in {self.folder} has no {what} token (looked for {token or candidates}); "
            "expected tokenizer_config.json to name one that is in the vocabulary"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def id_bound(self) -> int:
        """One past the highest id this tokenizer can produce (ids may be sparse, above
        vocab_size): the embedding rows a model needs for it."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

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


class MissingExtra(LongctxError):
    """An optional dependency is not installed: the message names the extra that brings it."""


# Llama 3's pre-tokenizer pattern, as in llama_models.llama3.tokenizer.Tokenizer.pat_str (checked
# against it on load: the reference is the package's own)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
    "<|image|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - 12)),
)  # fmt: skip
# the reference splits a text at 400k characters and at runs of 25k (non-)whitespace characters
# (a tiktoken stack limit, openai/tiktoken#195); a shorter text is never split
_LLAMA3_SPLIT_BELOW = 25_000


class Llama3Tokenizer:
    """Llama 3's tokenizer, 128,256 ids, from the ``tokenizer.model`` (tiktoken ranks) that Meta's
    ``llama-models`` package ships, with Llama 3's pre-tokenizer pattern and its 256 special
    tokens 128000..128255. Nothing is downloaded.

    Two encoders of the same ids: ``encode`` runs tiktoken on the package's ranks and pattern
    (the reference's own, ``llama_models.llama3.tokenizer.Tokenizer.encode(s, bos=False,
    eos=False)``, without its per-character Python loop), about 6x faster per core than a tokenizers
    BPE (benchmarks/bench_tokenize.py); ``fast_tokenizer()`` is the same vocabulary as a
    Hugging Face fast tokenizer (transformers' TikTokenConverter, built once per machine into
    ``$LONGCTX_CACHE/tokenizers``), the tokenizer.json an export carries. Tests hold the two
    (and the reference) to the same ids (tests/unit/test_llama3_tokenizer.py).

    As with the byte tokenizer, the text of a special token in a document is text; special ids
    come only from the pipeline (EOS after every document, BOS where packing adds it).
    """

    NAME = "llama3"
    vocab_size = 128256
    bos_id = 128000  # <|begin_of_text|>
    eos_id = 128001  # <|end_of_text|>: prepare ends every document with it
    eot_id = 128009  # <|eot_id|>: end of a chat turn (not a document boundary)
    pad_id = 128004  # <|finetune_right_pad_id|>, Meta's pad; pad positions carry no loss
    SPECIALS_IN_TEXT = "text"

    def __init__(self) -> None:
        self.model_file = llama3_model_file()
        self._enc = _llama3_tiktoken(str(self.model_file))

    def encode(self, text: str) -> np.ndarray:
        pieces = _reference_pieces(text)  # [text] below 25k characters
        return np.concatenate([self._ids(piece) for piece in pieces], dtype=np.int64)

    def _ids(self, text: str) -> np.ndarray:
        """encode_ordinary's ids (special-token text as text) as uint32, straight from tiktoken's
        buffer: no list of Python ints is built or converted (0.86-0.89x encode_ordinary's time
        per token, where the list and its conversion took 1.0x; benchmarks/bench_tokenize.py)."""
        try:  # no allowed specials: one regex pass over the whole text, as encode_ordinary
            return self._enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate: encode_ordinary (the reference) replaces it
            return np.asarray(self._enc.encode_ordinary(text), np.uint32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def fast_tokenizer(self):
        """The same vocabulary as a ``tokenizers.Tokenizer`` (what an export writes)."""
        return _llama3_fast_tokenizer(str(self.model_file))

    @property
    def spec(self) -> dict[str, Any]:
        return {
            "kind": self.NAME,
            "vocab_size": self.vocab_size,
            "sha256": _file_sha256(self.model_file),
            "specials_in_text": self.SPECIALS_IN_TEXT,
        }

    def __getstate__(self):  # worker processes rebuild from the package's file
        return {}

    def __setstate__(self, state):
        self.__init__()


def llama3_model_file() -> Path:
    """``llama_models/llama3/tokenizer.model`` of the installed package (found, not imported)."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(
            "the llama3 tokenizer needs the package llama-models (not installed); install the "
            "extra: pip install -e '.[llama3]' (or: pip install llama-models==0.3.0 tiktoken)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "llama3" / "tokenizer.model"


def _reference_pieces(text: str) -> list[str]:
    """The substrings the reference encodes one by one (only a text of 25k+ characters has
    more than one)."""
    if len(text) < _LLAMA3_SPLIT_BELOW:
        return [text]
    from llama_models.llama3.tokenizer import (
        MAX_NO_WHITESPACES_CHARS,
        TIKTOKEN_MAX_ENCODE_CHARS,
        Tokenizer,
    )

    split = Tokenizer._split_whitespaces_or_nonwhitespaces
    step = TIKTOKEN_MAX_ENCODE_CHARS
    return [
        piece
        for i in range(0, len(text), step)
        for piece in split(text[i : i + step], MAX_NO_WHITESPACES_CHARS)
    ]


@functools.lru_cache(maxsize=1)
def _llama3_tiktoken(model_file: str):
    """tiktoken's Encoding with the package's ranks, pattern and specials (the reference's)."""
    try:
        from llama_models.llama3.tokenizer import Tokenizer
    except ImportError as err:  # tiktoken missing: the reference cannot be imported
        raise MissingExtra(
            f"the llama3 tokenizer needs tiktoken ({err}); install the extra: "
            "pip install -e '.[llama3]'"
        ) from None
    if Tokenizer.pat_str != LLAMA3_PATTERN:
        raise AssertionError("llama_models' Llama 3 pattern differs from LLAMA3_PATTERN")
    reference = Tokenizer(Path(model_file))
    if list(reference.special_tokens) != list(LLAMA3_SPECIALS) or reference.n_words != 128256:
        raise AssertionError("llama_models' Llama 3 special tokens differ from LLAMA3_SPECIALS")
    return reference.model


@functools.lru_cache(maxsize=1)
def _llama3_fast_tokenizer(model_file: str):
    """The fast tokenizer, built from the ranks once per machine and cached. The cache is used
    only while its content has the digest recorded beside it when it was built: a file edited
    since (two ids swapped, say) or cut short is rebuilt, never exported."""
    import tokenizers

    cached = _llama3_cache_file(Path(model_file))
    text = _verified_cache(cached)
    if text is None:
        text = build_llama3_tokenizer(Path(model_file)).to_str()
        atomic_write_bytes(cached, text.encode())  # atomic: ranks building at once write the
        atomic_write_bytes(_digest_file(cached), _sha256_text(text).encode())  # same bytes
    tok = tokenizers.Tokenizer.from_str(text)
    tok.encode_special_tokens = True  # not stored in tokenizer.json: set on each load
    return tok


def _verified_cache(cached: Path) -> str | None:
    """The cached tokenizer.json's text when its digest matches the recorded one, else None
    (said when a cached file is there but differs)."""
    if not cached.is_file():
        return None
    text = cached.read_text(encoding="utf-8", errors="replace")
    digest = _digest_file(cached)
    if digest.is_file() and digest.read_text().strip() == _sha256_text(text):
        return text
    print(
        f"longctx: the cached tokenizer {cached} differs from what was built (or has no "
        "digest); rebuilding it from the model file",
        file=sys.stderr,
        flush=True,
    )
    return None


def _digest_file(cached: Path) -> Path:
    return cached.with_name(cached.name + ".sha256")


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _llama3_cache_file(model_file: Path) -> Path:
    path = cache_root() / "tokenizers" / f"llama3-{_file_sha256(model_file)[:16]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def build_llama3_tokenizer(model_file: Path):
    """A tokenizers.Tokenizer from Llama 3's tiktoken ranks: byte-level BPE (a piece that is a
    whole token maps to it, as tiktoken does), Llama 3's pattern, 256 specials from 128000."""
    try:
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as err:
        raise MissingExtra(
            f"the llama3 tokenizer needs transformers and tiktoken ({err}); install the extra: "
            "pip install -e '.[llama3]'"
        ) from None
    from tokenizers import AddedToken

    # specials added here: the converter's keyword for them differs between transformers 4 and 5
    # (and an unknown keyword is silently dropped); its post-processor adds no tokens
    tok = TikTokenConverter(vocab_file=str(model_file), pattern=LLAMA3_PATTERN).converted()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in LLAMA3_SPECIALS])
    ids = [tok.token_to_id(t) for t in LLAMA3_SPECIALS]
    if ids != list(range(128000, 128256)) or tok.get_vocab_size(with_added_tokens=True) != 128256:
        raise AssertionError(f"{model_file}: Llama 3's special ids moved")  # a package change
    return tok


def _file_sha256(path: Path) -> str:
    return _sha256_of(str(path))


@functools.lru_cache(maxsize=4)
def _sha256_of(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# the names load_tokenizer takes (anything else is a local tokenizer folder)
TOKENIZER_NAMES = ("byte", "llama3")


def load_tokenizer(spec: str | dict | Tokenizer) -> Tokenizer:
    """ "byte", "llama3", a local tokenizer folder, a manifest spec dict, or a Tokenizer (returned
    as is)."""
    if isinstance(spec, dict):
        kind = spec.get("kind")
        if kind == "byte":
            return ByteTokenizer()
        if kind == "llama3":
            return Llama3Tokenizer()
        if kind == "hf":
            return HFTokenizer(spec["path"])
        raise LongctxError(
            f"tokenizer spec {spec!r} has unknown kind; expected 'byte', 'llama3' or 'hf'"
        )
    if isinstance(spec, str | Path):
        if str(spec) == "byte":
            return ByteTokenizer()
        if str(spec) == "llama3":
            return Llama3Tokenizer()
        return HFTokenizer(spec)
    if isinstance(spec, Tokenizer):
        return spec
    raise TypeError(f"tokenizer {spec!r}; expected 'byte', 'llama3', a folder path, or a Tokenizer")


def data_tokenizer(name: str | None, folders: list[Path], manifests: list) -> dict:
    """The tokenizer of a run: the spec its prepared folders' manifests state (they must all
    state the same one). ``name`` (data.tokenizer), when set, must be that tokenizer: a run's
    tokenizer is its data's, whatever a config says."""
    first = manifests[0]
    for folder, m in zip(folders[1:], manifests[1:], strict=True):
        ids = (m.tokenizer, m.vocab_size, m.eos_id, m.pad_id)
        if ids != (first.tokenizer, first.vocab_size, first.eos_id, first.pad_id):
            raise LongctxError(
                f"{folder} was prepared with tokenizer {m.tokenizer}, {folders[0]} "
                f"with {first.tokenizer}; expected one tokenizer for all folders"
            )
    check_named_tokenizer(name, folders[0], first.tokenizer)
    return first.tokenizer


def check_named_tokenizer(
    name: str | Path | None, folder: Path, spec: dict, what: str = "data.tokenizer"
) -> None:
    """A prepared folder read under ``what=name`` was prepared with that tokenizer (a tokenizer
    folder: one with the same files)."""
    if name is None:
        return
    if not same_tokenizer(name, spec):
        kind = spec.get("kind")
        used = spec.get("path") if kind == "hf" else kind
        raise LongctxError(
            f"{folder} was prepared with tokenizer {used!r}, not {what}={str(name)!r}; drop "
            f"{what} (a run's tokenizer is its data's), or prepare the data with --tokenizer "
            f"{name}"
        )


def same_tokenizer(name: str | Path, spec: dict) -> bool:
    """``name`` ('byte', 'llama3' or a folder) is the tokenizer of the manifest spec ``spec``."""
    kind = spec.get("kind")
    if str(name) in TOKENIZER_NAMES:
        return kind == str(name)
    folder = Path(name).expanduser().resolve()  # the same files, wherever they are now
    return kind == "hf" and folder.is_dir() and _folder_sha256(folder) == spec.get("sha256")


def tokenizer_source(spec: dict) -> str:
    """What names the manifest spec's tokenizer to :func:`load_tokenizer` and an export: 'byte',
    'llama3', or the tokenizer folder. Refused when the tokenizer there is no longer the one
    the data was prepared with (its files' digest, or Llama 3's model file's, changed)."""
    kind = spec.get("kind")
    source = spec.get("path") if kind == "hf" else kind
    if kind == "hf" and not Path(str(source)).is_dir():
        raise FileNotFoundError(
            f"the data was prepared with the tokenizer folder {source}, which is gone; restore "
            "it (an export also takes a copy of it as --tokenizer)"
        )
    now = load_tokenizer(spec).spec.get("sha256")  # an unknown kind is refused here
    recorded = spec.get("sha256")
    if recorded is not None and now != recorded:
        raise LongctxError(
            f"the tokenizer {source!r} has changed since the data was prepared with it "
            f"(sha256 {str(recorded)[:16]}... then, {str(now)[:16]}... now); restore it, or "
            "prepare the data again"
        )
    return source


# the ids of each named tokenizer (what a model's vocabulary must hold)
TOKENIZER_IDS = {"byte": ByteTokenizer.vocab_size, "llama3": Llama3Tokenizer.vocab_size}
# BOS ids packing can put before each document, by tokenizer kind (a folder names none)
_BOS_IDS = {"byte": ByteTokenizer.bos_id, "llama3": Llama3Tokenizer.bos_id}


def packing_bos_id(add_bos: bool | None, spec: dict) -> int | None:
    """The id packing puts before every document, or None: ``add_bos`` None follows the
    tokenizer's convention (Llama 3: BOS first, as Meta, torchtitan and transformers encode a
    document; the byte tokenizer: none, as its golden curve was trained)."""
    kind = spec.get("kind")
    if add_bos is False or (add_bos is None and kind != "llama3"):
        return None
    if kind not in _BOS_IDS:
        raise LongctxError(
            f"data.add_bos=true with tokenizer {spec.get('path', kind)!r}, which names no BOS; "
            "expected data.add_bos=false or null with a tokenizer folder"
        )
    return _BOS_IDS[kind]


def _load_fast_tokenizer(folder: Path):
    import tokenizers

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer folder {folder} has no tokenizer.json; expected a Hugging Face fast "
            "tokenizer saved with save_pretrained() or tokenizers.Tokenizer.save()"
        )
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        raise LongctxError(
            f"{path} cannot be read as a tokenizers tokenizer.json ({' '.join(str(err).split())}); "
            "expected a Hugging Face fast tokenizer saved with save_pretrained()"
        ) from None


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
