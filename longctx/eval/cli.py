"""python -m longctx.eval CHECKPOINT: per-position loss and the passkey probe of a trained run.

The model and data config stored in the checkpoint (by train.py) rebuild the model as it was
trained; the checkpoint is read weights-only (a checkpoint is data: a crafted pickle in one
must not run code), and its ``model.*`` weights are loaded; the fixed validation set gives the loss by
position bucket; the long held-out documents give it out to ``--long-factor`` x seq_len
(longctx.eval.long_documents); the passkey probe gives accuracy by context length (up to the same
length) and needle depth. Results go to ``--out`` (default ``<run>/eval``) as CSV and JSON.

``--suite ruler`` scores the effective-length suite instead (longctx.eval.ruler: tasks, lengths,
depths, 95% CIs, effective length), on a checkpoint or, with ``--hf DIR``, on any local
transformers causal LM folder with plain transformers; results go to ``--out`` as CSV and JSON.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from longctx.cli import command
from longctx.data import LongCtxDataModule
from longctx.distributed.sharded import read_sharded_tensors
from longctx.errors import LongctxError
from longctx.eval.files import (
    EVAL_DIR,
    EVAL_SUMMARY_JSON,
    LONG_DOCUMENT_OCTAVES_CSV,
    LONG_DOCUMENTS_CSV,
    PASSKEY_ACCURACY_CSV,
    PASSKEY_PROBES_CSV,
    POSITION_LOSS_CSV,
    write_json,
    write_rows,
)
from longctx.eval.long_documents import (
    check_eval_length,
    check_factor,
    load_long_documents,
    octave_table,
    probe_lengths,
    score_long_documents,
)
from longctx.eval.passkey import accuracy_table, make_probes, score_probes
from longctx.eval.position_loss import PositionLoss
from longctx.eval.ruler.callback import default_ruler_lengths
from longctx.eval.ruler.generate import DEFAULT_DEPTHS
from longctx.eval.ruler.hf import load_hf_folder
from longctx.eval.ruler.instances import RulerInputError
from longctx.eval.ruler.scoring import GENERATE, SCORING_MODES
from longctx.eval.ruler.suite import SuiteSettings, run_suite
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.hf.weight_source import check_finite_weights
from longctx.model.attention import resolve_backend
from longctx.runs.folder import run_folder_of
from longctx.runs.record import read_stored_run


def load_configs(stored, seq_len: int | None, cache_dir: str | None, backend: str | None):
    """(model config, DataConfig) from a checkpoint's validated run record, with CLI overrides."""
    model_config = stored.model_config(**({"attn_backend": backend} if backend else {}))
    data = {"seq_len": seq_len} if seq_len is not None else {}
    if cache_dir is not None:
        data["cache_dir"] = cache_dir
    return model_config, stored.data_config(**data)


def model_state_dict(state: dict, path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in a Lightning checkpoint's contents (keys ``model.`` or
    ``model._orig_mod.``)."""
    weights = state.get("state_dict", state) if isinstance(state, dict) else {}
    out = {}
    for key, value in weights.items():
        for prefix in ("model._orig_mod.", "model."):
            if key.startswith(prefix):
                out[key[len(prefix) :]] = value
                break
    if not out:
        raise LongctxError(
            f"{path} has no 'model.*' weights (keys start {list(weights)[:5]}); expected a "
            "checkpoint written by train.py"
        )
    return out


def checkpoint_weights(stored) -> dict[str, torch.Tensor]:
    """The trained model's weights: memory-mapped from a .ckpt file, or read (as data) from
    a sharded checkpoint folder."""
    if stored.checkpoint.is_dir():
        return model_state_dict(read_sharded_tensors(stored.checkpoint, "state_dict."),
                                stored.checkpoint)  # fmt: skip
    return model_state_dict(stored.contents, stored.checkpoint)


def load_model(stored, model_config, device: str):
    """The run's model (longctx's Llama or a model=hf one) built from its record's config,
    holding the checkpoint's weights; a record that does not fit them is refused first, and
    weights with a NaN or inf after."""
    try:
        model = model_config.build_from(checkpoint_weights(stored))
    except LongctxError as err:
        raise LongctxError(f"{stored.checkpoint}: {err}") from None
    check_finite_weights(model, f"checkpoint {stored.checkpoint}")  # never scored as a model
    return model.to(device).eval()


@torch.no_grad()
def position_loss(model, datamodule, device: str) -> PositionLoss:
    """Loss by absolute and in-document bucket over the fixed validation set."""
    datamodule.prepare_data()
    acc = PositionLoss(datamodule.config.seq_len, eos_id=datamodule.eos_id)
    for batch in datamodule.val_dataloader():
        batch = batch.to(device)
        acc.update(model.token_loss(batch), batch)
    return acc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m longctx.eval", description=__doc__.split("\n")[0])
    add_default_options(p)
    add_suite_options(p)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_default_options(p: argparse.ArgumentParser) -> None:
    """The checkpoint and the default evaluation: per-position loss, long documents, passkey."""
    p.add_argument("checkpoint", type=Path, nargs="?", help="a .ckpt inside a train.py run folder")
    p.add_argument(
        "--seq-len", type=int, default=None, help="validation row length (default: run's)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: <run>/eval; --suite ruler: <run>/eval/ruler)",
    )
    p.add_argument("--backend", default=None, help="attention backend (default: the run's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache-dir", default=None, help="prepared-corpus cache (data.cache_dir)")
    p.add_argument(
        "--probe-lengths",
        type=int,
        nargs="*",
        default=None,
        help="passkey context lengths (default: 1024, 2048, ... up to --long-factor x seq_len)",
    )
    p.add_argument(
        "--long-factor",
        type=int,
        default=4,
        help="long held-out documents scored out to this many x seq_len (a power of two)",
    )
    p.add_argument("--probe-depths", type=float, nargs="*", default=list(DEFAULT_DEPTHS))
    p.add_argument("--probe-samples", type=int, default=4)
    p.add_argument("--probe-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-probe", action="store_true", help="skip the passkey probe")


def add_suite_options(p: argparse.ArgumentParser) -> None:
    """--suite ruler's options: what to score (a checkpoint or --hf folder), on which instances."""
    r = p.add_argument_group("the effective-length suite (--suite ruler)")
    r.add_argument(
        "--suite",
        choices=("default", "ruler"),
        default="default",
        help="default: per-position loss, long documents, passkey; ruler: the suite",
    )
    r.add_argument(
        "--hf",
        type=Path,
        default=None,
        help="score a local transformers causal LM folder instead of CHECKPOINT",
    )
    r.add_argument("--tasks", default=None, help="comma-separated (default: every task)")
    r.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=None,
        help="context lengths (default: seq_len/4, /2, 1x ... --long-factor x; "
        "with --hf 1024 2048 4096 within its positions)",
    )
    r.add_argument("--depths", type=float, nargs="*", default=list(DEFAULT_DEPTHS))
    r.add_argument("--samples", type=int, default=4, help="instances per task, length, depth")
    r.add_argument(
        "--haystack",
        default="books",
        help="books (the embedded held-out books), noise, or a prepared folder",
    )
    r.add_argument(
        "--qa-data",
        default=None,
        help="a folder with RULER's squad.json (qa_1) and/or hotpotqa.json (qa_2); without it "
        "qa_1 and qa_2 are skipped (nothing is downloaded)",
    )
    r.add_argument(
        "--scoring",
        choices=SCORING_MODES,
        default=GENERATE,
        help="generate: greedy generation scored with RULER's metrics (default); teacher_forced: "
        "every answer token the argmax, one forward pass (a stricter lower bound)",
    )
    r.add_argument(
        "--write-instances",
        action="store_true",
        help="also write every instance's text and answer (ruler_instances.jsonl)",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A list option given with no values, and neither or both of CHECKPOINT and --hf, refused."""
    for option in ("lengths", "depths", "probe_lengths", "probe_depths"):
        if getattr(args, option) == []:  # given with no values: not the defaults
            flag = "--" + option.replace("_", "-")
            raise RulerInputError(
                f"{flag} is given no values; expected one or more (leave {flag} out for the "
                "defaults)"
            )
    if args.hf is None and args.checkpoint is None:
        p.error("give a CHECKPOINT or --hf DIR")
    if args.hf is not None and args.checkpoint is not None:
        p.error(f"give a CHECKPOINT ({args.checkpoint}) or --hf DIR ({args.hf}), not both")


def run(args: argparse.Namespace) -> dict:
    if args.hf is not None:
        return run_hf(args)
    stored = read_stored_run(args.checkpoint, CONFIG_TARGETS)  # names a missing, unreadable file
    model_config, data_config = load_configs(stored, args.seq_len, args.cache_dir, args.backend)
    check_backend(model_config.attn_backend, args.device)
    out = args.out or _default_out(args.checkpoint.resolve(), args.suite)
    check_out(out)
    check_factor(args.long_factor)
    if args.suite == "ruler":
        lengths = args.lengths or default_ruler_lengths(data_config.seq_len, args.long_factor)
        settings = suite_settings(args, lengths)
        # the relative effective length is anchored at the training length, when evaluated
        settings.anchor = data_config.seq_len if data_config.seq_len in lengths else None
        settings.check(model_config.max_seq_len, "--lengths")
    else:
        check_lengths(args, model_config.max_seq_len, data_config.seq_len)
    model = load_model(stored, model_config, args.device)
    datamodule = LongCtxDataModule(data_config)
    if args.suite == "ruler":
        tokenizer = datamodule.tokenizer()
        return run_suite(model, tokenizer, settings, out, args.device, data_config.cache_dir)
    acc = position_loss(model, datamodule, args.device)
    summary = {
        "checkpoint": str(args.checkpoint),
        "seq_len": data_config.seq_len,
        "val_loss": acc.mean_loss(),
        "position_loss": acc.records(),
    }
    write_rows(acc.records(), out / POSITION_LOSS_CSV)
    long = score_long_documents(
        model,
        load_long_documents(data_config),
        data_config.seq_len,
        args.long_factor,
        model_config.max_seq_len,
        datamodule.pad_id,
        args.device,
    )
    summary["long_documents"] = octave_table(long["octaves"], data_config.seq_len, args.long_factor)
    write_rows(long["curve"], out / LONG_DOCUMENTS_CSV)
    write_rows(long["octaves"], out / LONG_DOCUMENT_OCTAVES_CSV)  # per document: for CIs
    if not args.no_probe:
        tokenizer = datamodule.tokenizer()
        lengths = args.probe_lengths or probe_lengths(data_config.seq_len, args.long_factor)
        probes = make_probes(tokenizer, lengths, args.probe_depths, args.probe_samples, args.seed)
        results = score_probes(model, probes, args.probe_batch_size, args.device)
        summary["passkey"] = accuracy_table(results)
        write_rows(results, out / PASSKEY_PROBES_CSV)
        write_rows(summary["passkey"], out / PASSKEY_ACCURACY_CSV)
    write_json(summary, out / EVAL_SUMMARY_JSON)
    octaves = ", ".join(f"{r['multiple']}x {r['loss']:.4f}" for r in summary["long_documents"])
    print(f"val loss {summary['val_loss']:.4f}; long documents by octave {octaves}; in {out}")
    return summary


def check_backend(name: str, device: str) -> None:
    """The attention backend (--backend, or the run's) runs on --device: one line before
    anything is loaded, not a RuntimeError at the first forward."""
    try:
        torch.device(device)
    except RuntimeError as err:
        raise LongctxError(
            f"--device {device} is not a device ({err}); expected cpu or cuda"
        ) from None
    try:
        resolve_backend(name, device)
    except RuntimeError as err:
        raise LongctxError(
            f"attention backend {name!r} (--backend, or the run's model.attn_backend) cannot run "
            f"on --device {device}: {err}"
        ) from None


def check_out(out: Path) -> None:
    """The output folder can be made (or is one): a file there is refused before anything is
    scored, not after the whole suite has run."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                raise FileExistsError(
                    f"--out {out}: {path} is a file; expected a folder (new or existing) for "
                    "the results"
                )
            return


def _default_out(checkpoint: Path, suite: str) -> Path:
    """<run>/eval for a checkpoint in a run folder, beside the checkpoint otherwise; the suite's
    in its ruler/ (beside the in-loop callback's eval/ruler_*, not over them)."""
    run = run_folder_of(checkpoint)
    out = (run if run is not None else checkpoint.parent) / EVAL_DIR
    return out / "ruler" if suite == "ruler" else out


def check_lengths(args: argparse.Namespace, max_seq_len: int, seq_len: int) -> None:
    """Every evaluation length within model.max_seq_len, before anything is loaded."""
    lengths = [(seq_len, "--seq-len / data.seq_len")]
    lengths.append((args.long_factor * seq_len, f"--long-factor {args.long_factor} x seq_len"))
    lengths += [(n, "--probe-lengths") for n in args.probe_lengths or [] if not args.no_probe]
    for length, what in lengths:
        check_eval_length(length, max_seq_len, what)


def suite_settings(args: argparse.Namespace, lengths: Sequence[int]) -> SuiteSettings:
    return SuiteSettings(
        args.tasks, list(lengths), args.depths, args.samples, args.seed, args.haystack,
        args.probe_batch_size, args.write_instances, args.scoring, qa_data=args.qa_data,
    )  # fmt: skip


def run_hf(args: argparse.Namespace) -> dict:
    """The suite on a local transformers folder, its own tokenizer, plain transformers."""
    if args.suite != "ruler":
        raise RulerInputError(
            f"--hf scores the effective-length suite only (--suite {args.suite}); pass "
            "--suite ruler"
        )
    if args.backend is not None:
        raise RulerInputError(
            f"--backend {args.backend} chooses longctx's attention for a CHECKPOINT; --hf scores "
            "with transformers' own attention: drop --backend"
        )
    settings = suite_settings(args, args.lengths or SuiteSettings.lengths)
    settings.check(None, "--lengths")
    out = args.out or Path("outputs") / "eval" / args.hf.resolve().name
    check_out(out)
    model, tokenizer, max_positions = load_hf_folder(args.hf, args.device)
    if args.lengths is None and max_positions is not None:
        settings.lengths = [n for n in SuiteSettings.lengths if n <= max_positions]
    settings.check_lengths(max_positions, "--lengths, the --hf model's max_position_embeddings")
    return run_suite(model, tokenizer, settings, out, args.device, args.cache_dir)


def main(argv: Sequence[str] | None = None) -> dict:
    return run(parse_args(argv))


cli = command(main)  # the console script and python -m: one-line errors, exit 2
