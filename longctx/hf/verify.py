"""Check an export against the model it came from:

    python -m longctx.hf.verify DIR [--documents N] [--tolerance T]
    python -m longctx.hf.export CKPT --out DIR --verify      (the same, right after exporting)

1. Logits: transformers' AutoModelForCausalLM on DIR against longctx's Llama on the run's
   checkpoint, on the first held-out documents of the run's data (the val split of its first
   prepared folder), each alone with positions from 0, in fp32. Beyond ``tolerance`` x the
   largest |logit| it fails (exit 2) naming the max difference.
2. Token ids: the export's tokenizer (transformers' AutoTokenizer) against the run's own (its
   data's, longctx.data.run_tokenizer) on the same documents; any difference fails (exit 2),
   naming the document and the first token that differs.
3. Bits per byte on the same documents, three ways:
   - lm-eval's ``loglikelihood_rolling`` through a local task that verify writes into a fresh
     private temporary folder of its own (when lm-eval is installed: ``pip install
     'longctx[eval]'``); it prefixes each document with the tokenizer's BOS (EOS when there is
     none) and scores every token of the text, no EOS;
   - longctx's model under that same convention (so lm-eval's number can be checked);
   - longctx's own convention, as its validation scores a document: its first token is only
     context, and the EOS that ends it is scored.
   The gap between the last two is the BOS/EOS difference (docs/evaluate-and-serve.md).
Documents are cut to fit one window of the export's max_position_embeddings, so lm-eval scores
each in one piece, as longctx does.

DIR is read, never executed or written: lm-eval reads every YAML of its include path and imports
the Python a ``!function`` names, so its task never comes from DIR (a ``DIR/lm_eval`` an older
export wrote, or one planted in a downloaded export, is ignored), and nothing is written there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from string import Template

import numpy as np
import torch

from longctx.batch import PackedBatch
from longctx.cli import USER_ERRORS, command, interactive
from longctx.data.run_tokenizer import data_folders, run_tokenizer
from longctx.data.shards import ShardSet
from longctx.data.tokenizer import load_tokenizer
from longctx.errors import LongctxError
from longctx.hf.config_targets import CONFIG_TARGETS
from longctx.hf.folders import LOCAL_ONLY, check_no_remote_code
from longctx.hf.run_model import llama_config, read_export_record, read_model
from longctx.runs.record import read_stored_run

TASK_NAME = "longctx_heldout"
TASK_YAML = Template("""\
task: $task
dataset_path: json
dataset_kwargs:
  data_files:
    test: $data
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
""")


class VerifyFailed(ValueError):
    """The export's logits differ from longctx's beyond the tolerance: a finding about the
    export, not a refusal of the user's input (the command line reports it in one line too)."""


@dataclass
class HeldOut:
    """Held-out documents as text and as the run's token ids (no EOS), and the run's specials."""

    texts: list[str]
    ids: list[np.ndarray]
    eos_id: int


def heldout_documents(data_config, count: int, max_tokens: int) -> HeldOut:
    """The first ``count`` documents of the val split of the run's first prepared folder (the
    embedded corpus when it has none), each cut to ``max_tokens`` and decoded to text."""
    folder = data_folders(data_config)[0]
    val = ShardSet(folder, "val")
    if val.num_documents == 0:
        raise LongctxError(
            f"{folder} has no val documents to verify on; prepare it with a val split"
        )
    tokenizer = load_tokenizer(run_tokenizer(data_config))  # the run's: its data's
    texts, ids = [], []
    for i in range(min(count, val.num_documents)):
        text = tokenizer.decode(val.document(i)[:-1][:max_tokens])
        text = text.rstrip("\ufffd")  # a character the cut split in two
        texts.append(text)
        ids.append(np.asarray(tokenizer.encode(text), np.int64))
    return HeldOut(texts, ids, int(val.manifest.eos_id))


def document_batch(ids: np.ndarray) -> PackedBatch:
    """One document alone in a row of its length, positions from 0."""
    tokens = torch.from_numpy(ids).unsqueeze(0)
    return PackedBatch.from_lengths(tokens, [[len(ids)]], reset_position_ids=True)


@torch.no_grad()
def logit_difference(ours, theirs, documents: list[np.ndarray]) -> tuple[float, float]:
    """(max |ours - theirs|, max |theirs|) over the documents' logits, each document alone."""
    diff = scale = 0.0
    for ids in documents:
        batch = document_batch(ids)
        expected = theirs(input_ids=batch.tokens, position_ids=batch.position_ids).logits
        diff = max(diff, float((ours(batch) - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
    return diff, scale


@torch.no_grad()
def nll_sum(model, inputs: np.ndarray, targets: np.ndarray) -> float:
    """Summed NLL (nats) of ``targets`` [T] after ``inputs`` [T], one document from position 0."""
    logits = model(document_batch(inputs))[0].double()
    target = torch.from_numpy(targets)
    return float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))


def bits_per_byte(model, held: HeldOut, prefix_id: int) -> tuple[float, float]:
    """(lm-eval's convention, longctx's own) bits per byte of ``model`` on ``held``."""
    rolling = own = 0.0
    for ids in held.ids:
        rolling += nll_sum(model, np.concatenate([[prefix_id], ids[:-1]]), ids)
        with_eos = np.concatenate([ids, [held.eos_id]])
        own += nll_sum(model, with_eos[:-1], with_eos[1:])
    total_bytes = sum(len(t.encode("utf-8")) for t in held.texts)
    return rolling / math.log(2) / total_bytes, own / math.log(2) / total_bytes


def write_lm_eval_task(texts: list[str]) -> Path:
    """A fresh private folder (mkdtemp: 0700, a new name) with the held-out documents (JSONL) and
    a loglikelihood_rolling task over them, for ``lm_eval --include_path FOLDER --tasks
    longctx_heldout`` (nothing downloaded). Never the export's folder: lm-eval would read (and
    import) whatever else lies there."""
    task_dir = Path(tempfile.mkdtemp(prefix="longctx-verify-lm-eval-"))
    data = task_dir / "heldout.jsonl"
    data.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    yaml = TASK_YAML.substitute(task=TASK_NAME, data=json.dumps(str(data)))
    (task_dir / f"{TASK_NAME}.yaml").write_text(yaml)
    return task_dir


def lm_eval_command(folder: Path, task_dir: Path) -> str:
    return (
        f"lm_eval --model hf --model_args pretrained={folder},dtype=float32 --device cpu "
        f"--tasks {TASK_NAME} --include_path {task_dir} --batch_size 1"
    )


def run_lm_eval(folder: Path, task_dir: Path, prefix_token_id: int | None = None) -> float:
    """lm-eval's bits per byte of the export on its local task, run in this process offline;
    ``prefix_token_id`` replaces the token lm-eval puts before each document (its BOS)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    prefix = "" if prefix_token_id is None else f",prefix_token_id={prefix_token_id}"
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},dtype=float32,trust_remote_code=False" + prefix,
        tasks=[TASK_NAME],
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=1,
        device="cpu",
        log_samples=False,
        verbosity="WARNING",
    )
    return float(results["results"][TASK_NAME]["bits_per_byte,none"])


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


@dataclass
class Verified:
    max_diff: float
    max_logit: float
    documents: int
    bpb_longctx_rolling: float
    bpb_longctx_own: float
    bpb_lm_eval: float | None


def verify(folder: str | Path, documents: int = 10, tolerance: float = 1e-4) -> Verified:
    """Check the export at ``folder``; see the module docstring. Prints what it measured."""
    import transformers

    folder = Path(folder)
    record = read_export_record(folder)
    check_no_remote_code(folder)  # before transformers reads anything of it
    if not interactive():  # transformers' loading bars, as longctx's own, only on a terminal
        transformers.utils.logging.disable_progress_bar()
    stored = read_stored_run(record.checkpoint, CONFIG_TARGETS)
    ours = read_model(stored.checkpoint, llama_config(stored))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, **LOCAL_ONLY
    )
    held = heldout_documents(stored.data_config(), documents, record.max_position_embeddings - 1)
    diff, scale = logit_difference(ours, theirs.eval(), held.ids)
    print(
        f"logits on {len(held.ids)} held-out documents: max |diff| {diff:.3g} ({diff / scale:.3g} of max |logit| {scale:.3g})"
    )
    if diff > tolerance * scale:
        raise VerifyFailed(
            f"the export's logits differ from longctx's by {diff:.3g} (max |logit| {scale:.3g}; "
            f"tolerance {tolerance:g} x max |logit| = {tolerance * scale:.3g}); the export does "
            "not compute the trained model"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **LOCAL_ONLY)
    check_same_ids(tokenizer, held)
    prefix = (
        tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    )
    rolling, own = bits_per_byte(ours, held, prefix)
    task_dir = write_lm_eval_task(held.texts)
    lm = None
    if lm_eval_installed():
        try:
            lm = run_lm_eval(folder, task_dir)
        finally:
            shutil.rmtree(task_dir, ignore_errors=True)
    _print_bits(lm, rolling, own, folder, task_dir)
    return Verified(diff, scale, len(held.ids), rolling, own, lm)


def check_same_ids(tokenizer, held: HeldOut) -> None:
    """The export's tokenizer gives the run's ids on every held-out document (as a user calls
    it: nothing added around the text), or VerifyFailed naming the first difference."""
    for i, (text, ids) in enumerate(zip(held.texts, held.ids, strict=True)):
        theirs, ours = list(tokenizer(text)["input_ids"]), ids.tolist()
        if theirs != ours:
            at = next(k for k in range(len(ours) + 1) if theirs[k : k + 1] != ours[k : k + 1])
            raise VerifyFailed(
                f"the export's tokenizer encodes held-out document {i} differently from the "
                f"run's ({len(theirs)} ids against {len(ours)}; first difference at token {at}: "
                f"{theirs[at : at + 3]} against {ours[at : at + 3]}); the export does not carry the "
                "tokenizer the model was trained with"
            )
    print(f"tokenizer: the export's ids equal the run's on {len(held.ids)} held-out documents")


def _print_bits(lm: float | None, rolling: float, own: float, folder: Path, task: Path) -> None:
    if lm is None:
        print(f"lm-eval: not installed (pip install 'longctx[eval]'); its task is in {task}")
    else:
        print(f"bits per byte: lm-eval {lm:.4f}")
    print(f"bits per byte: longctx, lm-eval's convention (BOS prefix, no EOS) {rolling:.4f}")
    print(f"bits per byte: longctx's own (first token context, EOS scored) {own:.4f}")
    if lm is None:
        print(f"next: {lm_eval_command(folder, task)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m longctx.hf.verify",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("folder", help="a folder written by python -m longctx.hf.export")
    add_verify_options(ap)
    return ap.parse_args(argv)


def add_verify_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--documents", type=int, default=10, help="held-out documents to verify on")
    ap.add_argument("--tolerance", type=float, default=1e-4, help="max |diff| / max |logit|")


def main(argv: list[str] | None = None) -> Verified:
    args = parse_args(argv)
    return verify(args.folder, args.documents, args.tolerance)


# the console script and python -m: one-line errors, exit 2, a failed verification among them
cli = command(main, (*USER_ERRORS, VerifyFailed))

if __name__ == "__main__":
    cli()
