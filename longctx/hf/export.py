"""Export a longctx checkpoint as a transformers folder:

    python -m longctx.hf.export CKPT --out DIR [--tokenizer TOK] [--verify]

CKPT is a .ckpt file, a sharded (FSDP) checkpoint folder, or a run folder (its last checkpoint).
The model and data config come from the checkpoint's run record (longctx.runs.record: the
config that trained those weights, validated as data). DIR gets
- config.json for LlamaForCausalLM: the run's RoPE (base and scaling), its special ids, and
  ``max_position_embeddings`` by the rule of :mod:`longctx.hf.lengths`;
- generation_config.json with the bos/eos/pad ids;
- the weights as safetensors, sharded with a model.safetensors.index.json above --max-shard-size;
- the tokenizer: the run's, which is the tokenizer its data was prepared with (the manifests':
  the bytes, llama3 or a tokenizer folder; --tokenizer TOK, if given, must be that one),
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
import shutil
import tempfile
from pathlib import Path

from longctx.cli import bar, command
from longctx.data.run_tokenizer import run_tokenizer
from longctx.data.tokenizer import TOKENIZER_NAMES, check_named_tokenizer, tokenizer_source
from longctx.hf.checkpoint import save_hf
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.hf.export_tokenizer import write_json, write_tokenizer
from longctx.hf.lengths import max_positions, trained_length
from longctx.hf.run_model import EXPORT_RECORD, llama_config, read_model, weights_source
from longctx.hf.verify import add_verify_options, verify
from longctx.io import make_readable
from longctx.model import Llama
from longctx.runs.record import read_stored_run

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass
class Export:
    """An export's folder and what it states."""

    folder: Path
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
    stored = read_stored_run(checkpoint, CONFIG_TARGETS)  # the config that trained the weights
    config, data = llama_config(stored), stored.data_config()
    tokenizer = run_tokenizer_source(data, tokenizer)
    weights_source(stored.checkpoint, config)  # shapes agree, before anything is allocated
    trained = trained_length(data)
    length = max_positions(config, trained)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent.resolve()))
    try:
        specials = write_tokenizer(tokenizer, staging, length, config.vocab_size)
        model = read_model(stored.checkpoint, config)
        _write_model(model, staging, max_shard_size, length, specials)
        record = {"checkpoint": str(stored.checkpoint.resolve()), "trained_length": trained}
        write_json(staging / EXPORT_RECORD, {**record, "max_position_embeddings": length})
        make_readable(staging)  # mkdtemp made it 0700, safetensors its files 0600
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)  # the folder appears whole or not at all
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Export(out, trained, length)


def run_tokenizer_source(data, given: str | Path | None) -> str:
    """The tokenizer the export carries: the run's, which is its data's
    (longctx.data.run_tokenizer). ``given`` (--tokenizer) must be that one; it names the
    tokenizer only where the run's data is not on this machine, or its tokenizer folder moved."""
    try:
        spec = run_tokenizer(data)
    except FileNotFoundError as err:
        if given is None:
            raise FileNotFoundError(
                f"the run's data, whose tokenizer the export carries, is not readable here "
                f"({err}); make it readable, or pass --tokenizer with the tokenizer it was "
                "prepared with"
            ) from err
        print(f"the run's data is not readable here ({err}); exporting with --tokenizer {given}")
        return str(given)
    check_named_tokenizer(given, "the run's data", spec, "--tokenizer")
    if given is not None and str(given) not in TOKENIZER_NAMES:
        return str(given)  # the data's tokenizer files (compared above), wherever they are now
    return tokenizer_source(spec)


def _write_model(model: Llama, folder: Path, max_shard_size: str, length: int, specials) -> None:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    config_extra = {"max_position_embeddings": length, **specials}
    with bar(total, "writing weights", unit="B") as progress:
        save_hf(model, folder, max_shard_size, on_bytes=progress.update, **config_extra)
    write_json(folder / GENERATION_CONFIG, {**specials, "_from_model_config": False})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m longctx.hf.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("checkpoint", help="a longctx .ckpt file, sharded checkpoint or run folder")
    ap.add_argument("--out", required=True, help="a new (or empty) folder")
    ap.add_argument("--max-shard-size", default="5GB", help="shard above this size (e.g. 5GB)")
    ap.add_argument(
        "--tokenizer",
        help="the tokenizer the run's data was prepared with (default: its manifests'); needed only "
        "where that data is not on this machine",
    )
    ap.add_argument(
        "--verify", action="store_true", help="then check it (python -m longctx.hf.verify)"
    )
    add_verify_options(ap)
    return ap.parse_args(argv)


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
