"""Export a longctx checkpoint as a transformers folder:

    python -m longctx.hf.export CKPT --out DIR [--tokenizer TOK] [--verify]

CKPT is anything ``model.init_from`` reads from longctx: a .ckpt file, a sharded (FSDP)
checkpoint folder, or a run folder (its last checkpoint). DIR gets
- config.json for LlamaForCausalLM: the run's RoPE (base and scaling), its special ids, and
  ``max_position_embeddings`` by the rule of :mod:`longctx.hf.lengths`;
- generation_config.json with the bos/eos/pad ids;
- the weights as safetensors, sharded with a model.safetensors.index.json above --max-shard-size;
- the tokenizer: the byte tokenizer (or --tokenizer TOK, the folder the run was prepared with),
  encoding every string as prepare did (:mod:`longctx.hf.export_tokenizer`);
- longctx_export.json: where it came from and the lengths.
transformers 4.x and 5.x (AutoModelForCausalLM, AutoTokenizer, pipeline, generate), and through
them lm-eval and vLLM, open it. Files are 0644 and folders 0755 (under umask 022), readable by a
serving container or a colleague. DIR must be new or empty: an export never overwrites, and it
appears whole or not at all. --verify then reloads it with transformers and compares logits
(and, where lm-eval is installed, runs its perplexity task on held-out documents).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from longctx.cli import command
from longctx.data.tokenizer import ByteTokenizer
from longctx.hf.export_tokenizer import write_byte_tokenizer, write_user_tokenizer
from longctx.hf.lengths import max_positions, trained_length
from longctx.hf.verify import add_verify_options, verify
from longctx.io import make_readable
from longctx.model import Llama, LlamaConfig
from longctx.progress import bar
from longctx.train.init_from import InitFromError, resolve

EXPORT_RECORD = "longctx_export.json"
GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass
class RunConfig:
    """What an export needs of the run: its model, and its data config (lengths, held-out)."""

    model: LlamaConfig
    data: Any  # longctx.data.DataConfig


def run_config_of(checkpoint: Path) -> RunConfig:
    """The model and data config of the run that wrote ``checkpoint`` (its .hydra/config.yaml)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    run = checkpoint if (checkpoint / "checkpoints").is_dir() else checkpoint.parent.parent
    saved = run / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise InitFromError(
            f"{checkpoint}: no {saved} to read the model config from; expected a checkpoint "
            "inside a longctx run folder (run/checkpoints/*.ckpt) or the run folder itself"
        )
    cfg = OmegaConf.load(saved)
    config = instantiate(cfg.model)
    if not isinstance(config, LlamaConfig):
        raise InitFromError(
            f"{checkpoint} was trained with {type(config).__name__}, not longctx's Llama; a "
            "model=hf run's weights are already a transformers model"
        )
    try:
        OmegaConf.select(cfg, "data.cache_dir", throw_on_missing=True)
    except Exception:  # an interpolation only Hydra's runtime resolves: the default cache
        cfg.data.cache_dir = None
    return RunConfig(config, instantiate(cfg.data))


@dataclasses.dataclass
class Export:
    """An export's folder and what it states."""

    folder: Path
    run: RunConfig
    trained_length: int
    max_position_embeddings: int


def export(
    checkpoint: str | Path,
    out: str | Path,
    max_shard_size: str = "5GB",
    tokenizer: str | Path | None = None,
) -> Export:
    """Write the transformers folder; see the module docstring."""
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not empty; expected a new folder")
    run = run_config_of(checkpoint)
    config = run.model
    if tokenizer is None and config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"the byte tokenizer's {ByteTokenizer.vocab_size} ids do not fit the model's "
            f"vocab_size={config.vocab_size}; pass --tokenizer with the run's tokenizer folder"
        )
    trained = trained_length(run.data)
    length = max_positions(config, trained)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent.resolve()))
    try:
        specials = _write_tokenizer(tokenizer, staging, length, config.vocab_size)
        model = read_model(checkpoint, config)
        _write_model(model, staging, max_shard_size, length, specials)
        record = {"checkpoint": str(checkpoint.resolve()), "trained_length": trained}
        _write_json(staging / EXPORT_RECORD, {**record, "max_position_embeddings": length})
        make_readable(staging)  # mkdtemp made it 0700, safetensors its files 0600
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)  # the folder appears whole or not at all
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Export(out, run, trained, length)


def read_model(checkpoint: Path, config: LlamaConfig) -> Llama:
    """longctx's Llama with ``checkpoint``'s weights, on the CPU in fp32."""
    config = dataclasses.replace(config, init_from=str(checkpoint))
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    resolve(checkpoint).load_into(model)
    return model.eval()


def _write_tokenizer(tokenizer, folder: Path, length: int, vocab_size: int) -> dict[str, int]:
    if tokenizer is None:
        return write_byte_tokenizer(folder, length)
    return write_user_tokenizer(Path(tokenizer), folder, length, vocab_size)


def _write_model(model: Llama, folder: Path, max_shard_size: str, length: int, specials) -> None:
    from longctx.hf.checkpoint import save_hf

    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with bar(total, "writing weights", unit="B") as progress:
        save_hf(
            model,
            folder,
            max_shard_size,
            on_bytes=progress.update,
            max_position_embeddings=length,
            **specials,
        )
    _write_json(folder / GENERATION_CONFIG, {**specials, "_from_model_config": False})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# --------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m longctx.hf.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("checkpoint", help="a longctx .ckpt file, sharded checkpoint or run folder")
    ap.add_argument("--out", required=True, help="a new (or empty) folder")
    ap.add_argument("--max-shard-size", default="5GB", help="shard above this size (e.g. 5GB)")
    ap.add_argument("--tokenizer", help="the run's HF tokenizer folder (default: the bytes)")
    ap.add_argument(
        "--verify", action="store_true", help="then check it (python -m longctx.hf.verify)"
    )
    add_verify_options(ap)
    return ap.parse_args(argv)


@command
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    done = export(args.checkpoint, args.out, args.max_shard_size, args.tokenizer)
    print(
        f"exported {args.checkpoint} to {done.folder} (max_position_embeddings="
        f"{done.max_position_embeddings}; trained at {done.trained_length})"
    )
    if args.verify:
        verify(done.folder, args.documents, args.tolerance)
    else:
        print(f"next: python -m longctx.hf.verify {done.folder}")


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
