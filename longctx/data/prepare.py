"""Tokenise text files into memory-mapped token shards plus a manifest.

    python -m longctx.data.prepare INPUT... --tokenizer byte|/path/to/tokenizer --out DIR \\
        [--executor local --tasks N | --executor slurm --tasks N --partition P [--time T]]

Inputs: plain-text files (one document per file; globs allowed), JSONL (a ``text`` field,
optional ``id``) and Parquet (a ``text`` column, optional ``id``). Every document gets EOS.
A document goes to the validation split when the hash of its source id (its ``id`` field, or
the source file's sha256 plus its position in that file) falls below ``val_fraction``.

The work is a datatrove pipeline (pipeline.py) of N tasks, each a contiguous slice of the
inputs, run by datatrove's local executor (a process pool) or as a SLURM job array. Each task
writes its own shards; the manifest, written last, lists every task's shards in task order:
the documents in input order, the same for any N.

Re-running with the same inputs, tokenizer and options is a no-op (the manifest's input hash
matches and its shards are intact). A run that was interrupted, or in which a task failed,
left no manifest; rerunning it redoes only the tasks that did not finish.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

from longctx.cli import USER_ERRORS, bar, command
from longctx.data.pipeline import (
    PrepareTaskFailed,
    ReadDocuments,
    SlurmOptions,
    SlurmUnreachable,
    TaskResult,
    TokenizeDocuments,
    WriteShards,
    check_slurm_reachable,
    result_path,
    run_local,
    run_slurm,
)
from longctx.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PREPARED_MARKER,
    SPLITS,
    Manifest,
    SplitInfo,
    check_val_split,
    load_manifest,
    settings_digest,
    shard_files_intact,
    token_dtype,
    write_manifest,
)
from longctx.data.sources import Source, describe_source, expand_inputs, task_range
from longctx.data.tokenizer import Tokenizer, load_tokenizer
from longctx.errors import LongctxError
from longctx.io import atomic_write_bytes

__all__ = ["PrepareTaskFailed", "SlurmOptions", "prepare"]

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MiB of uint16 per shard
WORK_DIR = ".longctx-work"
EXECUTORS = ("local", "slurm")


def prepare(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path | Tokenizer = "byte",
    *,
    tasks: int | None = None,
    workers: int | None = None,
    executor: str = "local",
    slurm: SlurmOptions | None = None,
    val_fraction: float = 0.01,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> Manifest:
    """Prepare ``inputs`` into ``out_dir``; returns the (new or already present) manifest.

    ``tasks``: slices of the inputs (default: ``workers``, else the CPU count); ``workers``:
    local processes at once (default: min(tasks, CPUs)); ``executor="slurm"`` needs
    ``slurm=SlurmOptions(partition=...)``. ``progress=False`` keeps the task logs off the
    console (they are still written under ``out_dir/.longctx-work``).
    """
    tasks, workers = _check_options(val_fraction, shard_tokens, tasks, workers, executor, slurm)
    if executor == "slurm":
        check_slurm_reachable(slurm.partition)  # before anything is read or written
    out = Path(out_dir)
    tok = load_tokenizer(tokenizer)
    sources = [describe_source(path) for path in expand_inputs(inputs)]
    input_hash = _input_hash(sources, tok.spec, val_fraction, shard_tokens)
    existing = claim_output_folder(out, input_hash, overwrite)
    if existing is not None:
        return existing
    work = _work_dir(out, input_hash, tasks)
    dtype = token_dtype(tok.vocab_size)
    pipeline = [
        ReadDocuments(sources),
        TokenizeDocuments(tok, val_fraction, dtype),
        WriteShards(out, work / "results", dtype, shard_tokens),
    ]
    with task_progress(sources, tasks, work / "results", enabled=progress) as shown:
        if executor == "slurm":
            run_slurm(pipeline, tasks, work / "datatrove", slurm)
        else:  # the bar replaces datatrove's console log (its task logs stay in their files)
            run_local(pipeline, tasks, workers, work / "datatrove", quiet=shown or not progress)
    results = [TaskResult.load(result_path(work / "results", k)) for k in range(tasks)]
    # the tasks' shards in task order: the documents in input order
    splits = {split: _concat([r.splits[split] for r in results]) for split in SPLITS}
    skipped = sum(r.skipped_empty_documents for r in results)
    sources_listed = [s.to_dict() for s in sources]
    manifest = Manifest.of(input_hash, tok, splits, sources_listed, val_fraction, skipped)
    if not shard_files_intact(out, manifest):
        raise RuntimeError(
            f"{out}: a shard the tasks listed is missing or resized (was the folder edited "
            f"while prepare ran?); delete {work} and prepare again"
        )
    commit(out, manifest, ", ".join(str(s.path) for s in sources))
    return manifest


def commit(out: Path, manifest: Manifest, where: str) -> None:
    """Write the manifest (the commit point) of the shards in ``out``, read from ``where``, once
    it is checked, then drop the shards it does not list."""
    if manifest.splits["train"].documents + manifest.splits["val"].documents == 0:
        raise LongctxError(f"inputs {where} hold no non-empty documents")
    check_val_split(manifest.splits, manifest.val_fraction, where)
    write_manifest(out, manifest)
    _remove_unlisted_shards(out, manifest)


@contextlib.contextmanager
def task_progress(sources: list[Source], tasks: int, results: Path, enabled: bool):
    """A bar over the input bytes of the tasks that finished (each writes its result file
    last), on a terminal only; yields whether it is shown."""
    total = sum(s.bytes for s in sources)
    progress = bar(total, "prepare", unit="B", disable=not enabled)
    if progress.disable:
        yield False
        return
    ranges = [task_range(sources, k, tasks) for k in range(tasks)]
    spans = [min(hi, total) - lo for lo, hi in ranges]  # the last range ends one past the end
    stop, done = threading.Event(), set()

    def count_finished() -> None:
        for k in range(tasks):
            if k not in done and result_path(results, k).is_file():
                done.add(k)
                progress.update(spans[k])

    def watch() -> None:
        while not stop.wait(0.5):
            count_finished()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield True
    finally:
        stop.set()
        watcher.join()
        count_finished()
        progress.close()


def _remove_unlisted_shards(out: Path, manifest: Manifest) -> None:
    """Shards of earlier attempts with another task count (the folder is ours: marked)."""
    listed = {
        n
        for s in manifest.splits.values()
        for sh in s.shards
        for n in (sh.tokens_file, sh.index_file)
    }
    for pattern in ("train-*.npy", "val-*.npy"):
        for path in out.glob(pattern):
            if path.name not in listed:
                path.unlink()


def _check_options(val_fraction, shard_tokens, tasks, workers, executor, slurm):
    if not 0.0 <= val_fraction < 1.0:
        raise LongctxError(f"val_fraction={val_fraction}; expected 0 <= val_fraction < 1")
    if shard_tokens < 1:
        raise LongctxError(f"shard_tokens={shard_tokens}; expected >= 1")
    for name, value in (("tasks", tasks), ("workers", workers)):
        if value is not None and value < 1:
            raise LongctxError(f"{name}={value}; expected >= 1 (or None for the CPU count)")
    if executor not in EXECUTORS:
        raise LongctxError(f"executor={executor!r}; expected one of {EXECUTORS}")
    if executor == "slurm" and slurm is None:
        raise LongctxError("executor='slurm' needs slurm=SlurmOptions(partition=...)")
    cpus = os.cpu_count() or 1
    tasks = tasks or workers or cpus
    return tasks, min(workers or cpus, tasks)


def claim_output_folder(out: Path, input_hash: str, overwrite: bool) -> Manifest | None:
    """The manifest already in ``out`` when it is this exact preparation and intact. Else None,
    once ``out`` is created, marked ours and rid of its old manifest (the old commit point);
    a non-empty folder that prepare did not make is refused.

    The marker is written before any shard, so an interrupted run's folder is still ours.
    """
    if (out / MANIFEST_NAME).is_file():
        manifest = load_manifest(out)
        if manifest.input_hash == input_hash and shard_files_intact(out, manifest):
            return manifest
        if manifest.input_hash != input_hash and not overwrite:
            raise FileExistsError(
                f"{out} holds a corpus prepared from other inputs or options (input hash "
                f"{manifest.input_hash[:12]}, this run {input_hash[:12]}); choose another output "
                "folder or pass overwrite=True / --overwrite"
            )
    elif out.is_dir() and not (out / PREPARED_MARKER).is_file() and any(out.iterdir()):
        raise FileExistsError(
            f"--out {out} is a non-empty folder that holds no prepared corpus (no "
            f"{MANIFEST_NAME} or {PREPARED_MARKER}); expected a new or empty folder, so "
            "prepare never writes among (or deletes) files that are not its own"
        )
    out.mkdir(parents=True, exist_ok=True)
    if not (out / PREPARED_MARKER).is_file():
        atomic_write_bytes(out / PREPARED_MARKER, b"written by python -m longctx.data.prepare\n")
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    return None


def _work_dir(out: Path, input_hash: str, tasks: int) -> Path:
    """This preparation's task results and logs; other preparations' (ours too) are dropped."""
    work = out / WORK_DIR / f"{input_hash[:16]}-{tasks}tasks"
    if (out / WORK_DIR).is_dir():
        for old in (out / WORK_DIR).iterdir():
            if old != work:
                shutil.rmtree(old)
    return work


def _input_hash(sources: list[Source], spec: dict, val_fraction: float, shard_tokens: int) -> str:
    key = {
        "sources": [(s.sha256, s.format) for s in sources],
        "tokenizer": spec,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "format_version": FORMAT_VERSION,
    }
    return settings_digest(key)


def _concat(splits: list[SplitInfo]) -> SplitInfo:
    return SplitInfo(
        documents=sum(s.documents for s in splits),
        tokens=sum(s.tokens for s in splits),
        shards=[shard for s in splits for shard in s.shards],
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m longctx.data.prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("inputs", nargs="+", help="text/.jsonl/.parquet files or globs")
    parser.add_argument("--tokenizer", default="byte", help="byte, llama3 or a tokenizer folder")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--executor", choices=EXECUTORS, default="local")
    parser.add_argument("--tasks", type=int, default=None, help="slices (default: CPUs)")
    parser.add_argument("--workers", type=int, default=None, help="local processes at once")
    parser.add_argument("--partition", help="SLURM partition (--executor slurm)")
    parser.add_argument("--time", default=SlurmOptions.time, help="SLURM time limit per task")
    parser.add_argument("--cpus-per-task", type=int, default=SlurmOptions.cpus_per_task)
    parser.add_argument("--mem-per-cpu-gb", type=int, default=SlurmOptions.mem_per_cpu_gb)
    parser.add_argument("--qos", default=None, help="SLURM QOS (default: the cluster's)")
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    slurm = None
    if args.executor == "slurm":
        if not args.partition:
            parser.error("--executor slurm needs --partition")
        slurm = SlurmOptions(
            args.partition, args.time, args.cpus_per_task, args.mem_per_cpu_gb, args.qos
        )
    manifest = prepare(
        args.inputs,
        args.out,
        args.tokenizer,
        tasks=args.tasks,
        workers=args.workers,
        executor=args.executor,
        slurm=slurm,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        overwrite=args.overwrite,
    )
    print_written(manifest, args.out)


def print_written(manifest: Manifest, out: str) -> None:
    for name, split in manifest.splits.items():
        print(
            f"{name}: {split.documents} documents, {split.tokens} tokens, "
            f"{len(split.shards)} shards ({manifest.dtype})"
        )
    print(f"wrote {out}")
    print(f"next: python train.py data=shards data.shards={out}")


cli = command(
    main, USER_ERRORS + (PrepareTaskFailed, SlurmUnreachable)
)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
