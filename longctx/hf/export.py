"""Export a longctx checkpoint as a transformers folder: ``python -m longctx.hf.export CKPT --out DIR``.

CKPT is anything ``model.init_from`` reads from longctx (a .ckpt file, a sharded checkpoint
folder, or a run folder); the model config comes from its run's ``.hydra/config.yaml``. DIR gets
- config.json for LlamaForCausalLM, with the run's RoPE settings (base and scaling);
- the weights as safetensors, sharded with a model.safetensors.index.json above --max-shard-size;
- the tokenizer: the byte tokenizer as a PreTrainedTokenizerFast (or --tokenizer DIR's files),
so that AutoModelForCausalLM / AutoTokenizer, and through them lm-eval and vLLM, open it.
DIR must be empty or absent: an export never overwrites.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from longctx.cli import command
from longctx.data.tokenizer import ByteTokenizer
from longctx.model import Llama, LlamaConfig
from longctx.train.init_from import InitFromError, resolve

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BYTE_SPECIALS = {ByteTokenizer.PAD: "<pad>", ByteTokenizer.BOS: "<s>", ByteTokenizer.EOS: "</s>"}


def run_config_of(checkpoint: Path) -> LlamaConfig:
    """The LlamaConfig of the run that wrote ``checkpoint`` (its .hydra/config.yaml)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    run = checkpoint if (checkpoint / "checkpoints").is_dir() else checkpoint.parent.parent
    saved = run / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise InitFromError(
            f"{checkpoint}: no {saved} to read the model config from; expected a checkpoint "
            "inside a longctx run folder (run/checkpoints/*.ckpt) or the run folder itself"
        )
    config = instantiate(OmegaConf.load(saved).model)
    if not isinstance(config, LlamaConfig):
        raise InitFromError(
            f"{checkpoint} was trained with {type(config).__name__}, not longctx's Llama; a "
            "model=hf run's weights are already a transformers model"
        )
    return config


def export(checkpoint: str | Path, out: str | Path, max_shard_size: str = "5GB", tokenizer=None):
    """Write the transformers folder; see the module docstring."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not empty; expected a new folder")
    config = run_config_of(checkpoint)
    if tokenizer is None and config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"the byte tokenizer's {ByteTokenizer.vocab_size} ids do not fit the model's "
            f"vocab_size={config.vocab_size}; pass --tokenizer with the run's tokenizer folder"
        )
    model = _read(checkpoint, config)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent.resolve()))
    try:
        _write(model, staging, max_shard_size, tokenizer)
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)  # the folder appears whole or not at all
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _read(checkpoint: Path, config: LlamaConfig) -> Llama:
    import dataclasses

    config = dataclasses.replace(config, init_from=str(checkpoint))
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    resolve(checkpoint).load_into(model)
    return model


def _write(model: Llama, folder: Path, max_shard_size: str, tokenizer) -> None:
    from longctx.hf.checkpoint import save_hf

    specials = {}
    if tokenizer is None:
        byte = ByteTokenizer
        specials = dict(bos_token_id=byte.BOS, eos_token_id=byte.EOS, pad_token_id=byte.PAD)
    save_hf(model, folder, max_shard_size, **specials)
    if tokenizer is None:
        byte_tokenizer_fast().save_pretrained(folder)
    else:
        _copy_tokenizer(Path(tokenizer), folder)


def byte_tokenizer_fast():
    """longctx's ByteTokenizer as a transformers PreTrainedTokenizerFast: id b for byte b (GPT-2's
    byte-to-character alphabet, no merges), then <pad> 256, <s> 257, </s> 258. Special tokens
    are added to nothing (longctx adds none when it encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    names = [BYTE_SPECIALS[i] for i in sorted(BYTE_SPECIALS)]
    tok.add_special_tokens(names)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    assert [fast.convert_tokens_to_ids(n) for n in names] == sorted(BYTE_SPECIALS)
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte, as tokenizers' ByteLevel maps them: printable
    Latin-1 bytes stand for themselves, the others take code points from 256 on, in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


def _copy_tokenizer(source: Path, folder: Path) -> None:
    files = [source / n for n in HF_TOKENIZER_FILES if (source / n).is_file()]
    if not (source / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--tokenizer {source} has no tokenizer.json")
    for file in files:
        shutil.copy2(file, folder / file.name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m longctx.hf.export", description=__doc__)
    ap.add_argument("checkpoint", help="a longctx .ckpt file, sharded checkpoint or run folder")
    ap.add_argument("--out", required=True, help="a new (or empty) folder")
    ap.add_argument("--max-shard-size", default="5GB", help="shard above this size (e.g. 5GB)")
    ap.add_argument("--tokenizer", help="an HF tokenizer folder to copy (default: the bytes)")
    args = ap.parse_args(argv)
    path = export(args.checkpoint, args.out, args.max_shard_size, args.tokenizer)
    print(f"exported {args.checkpoint} to {path}")


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
