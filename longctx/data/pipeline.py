"""`prepare` as a datatrove pipeline: read -> tokenise -> write shards, one task per slice of
the inputs, run by datatrove's local or SLURM executor.

Each task writes its own shards (``train-<task>-<n>``) and, last, a small result file listing
them. datatrove marks a task complete after that, and a rerun skips completed tasks, so a
task that failed or was killed is the only one redone. `prepare` lays the tasks' results end to
end into the manifest (sources.py explains why that is input order).

The readers are longctx's own (sources.py), not datatrove's: they give each document the
source id that decides the validation split, and they stop on a malformed line naming it,
where datatrove's JSONL reader logs it and goes on without the document.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from copy import deepcopy
from functools import partial
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from datatrove.utils.logging import logger, setup_default_logger

from longctx.data.shards import SplitInfo, splits_from_dict, task_writers
from longctx.data.sources import Source, documents_of_task, is_validation
from longctx.data.tokenizer import Tokenizer
from longctx.errors import LongctxError
from longctx.io import atomic_write_bytes


class PrepareTaskFailed(RuntimeError):
    """A prepare task failed or did not finish; the message names it and its log."""


class SlurmUnreachable(RuntimeError):
    """--executor slurm where no SLURM answers."""


@dataclasses.dataclass
class SlurmOptions:
    """Where and how `prepare --executor slurm` submits its job array."""

    partition: str
    time: str = "1-00:00:00"
    cpus_per_task: int = 1
    mem_per_cpu_gb: int = 2
    qos: str | None = None
    job_name: str = "longctx-prepare"
    poll_seconds: float = 2.0


@dataclasses.dataclass
class TaskResult:
    """What one task wrote: its shards per split, and the empty documents it skipped."""

    splits: dict[str, SplitInfo]
    skipped_empty_documents: int

    @classmethod
    def load(cls, path: Path) -> TaskResult:
        data = json.loads(Path(path).read_text())
        splits = splits_from_dict(data["splits"], str(path))
        return cls(splits, int(data["skipped_empty_documents"]))


class ReadDocuments(PipelineStep):
    name, type = "longctx sources", "📖 - READER"

    def __init__(self, sources: list[Source]) -> None:
        super().__init__()
        self.sources = sources

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        for source_id, text in documents_of_task(self.sources, rank, world_size):
            yield Document(text=text, id=source_id)


class TokenizeDocuments(PipelineStep):
    """Tokens (with EOS; empty for an empty document) and the split, in ``metadata``."""

    name, type = "longctx tokenizer", "🔢 - TOKENIZER"

    def __init__(self, tokenizer: Tokenizer, val_fraction: float, dtype: str) -> None:
        super().__init__()
        self.tokenizer, self.val_fraction, self.dtype = tokenizer, val_fraction, dtype

    def run(self, data, rank: int = 0, world_size: int = 1):
        tok = self.tokenizer
        for doc in data:
            ids = np.asarray(tok.encode(doc.text))
            if len(ids) and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                raise LongctxError(
                    f"document {doc.id!r}: tokenizer returned id {int(ids.max())} outside "
                    f"[0, {tok.vocab_size})"
                )
            tokens = np.empty(len(ids) + 1 if len(ids) else 0, self.dtype)  # the shard dtype:
            tokens[:-1], tokens[-1:] = ids, tok.eos_id  # one conversion, no int64 copies
            doc.metadata["tokens"] = tokens
            doc.metadata["val"] = is_validation(doc.id, self.val_fraction)
            yield doc


class WriteShards(PipelineStep):
    """Shards of this task's documents, then its result file (written last, atomically)."""

    name, type = "longctx shard writer", "💽 - WRITER"

    def __init__(self, out: Path, results: Path, dtype: str, shard_tokens: int) -> None:
        super().__init__()
        self.out, self.results = Path(out), Path(results)
        self.dtype, self.shard_tokens = dtype, shard_tokens

    def run(self, data, rank: int = 0, world_size: int = 1):
        writers = task_writers(self.out, rank, self.dtype, self.shard_tokens)
        skipped = 0
        for doc in data:
            tokens = doc.metadata["tokens"]
            if len(tokens) == 0:
                skipped += 1
                continue
            writers["val" if doc.metadata["val"] else "train"].add(tokens)
        result = TaskResult({s: w.close() for s, w in writers.items()}, skipped)
        for split, info in result.splits.items():  # totals once: datatrove's per-document
            self.stat_update(f"{split}_documents", value=info.documents)  # stats cost 15 us
            self.stat_update(f"{split}_tokens", value=info.tokens)  # a call
        self.results.mkdir(parents=True, exist_ok=True)
        text = json.dumps(dataclasses.asdict(result), indent=1)
        atomic_write_bytes(result_path(self.results, rank), text.encode())
        yield from ()


def result_path(results: Path, rank: int) -> Path:
    return Path(results) / f"{rank:05d}.json"


class _LocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor; a failing task's error names the task and its log."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        except Exception as err:
            log = Path(self.logging_dir.resolve_paths(f"logs/task_{rank:05d}.log"))
            raise PrepareTaskFailed(
                f"prepare task {rank} of {self.tasks} failed: {type(err).__name__}: {err}\n"
                f"  its log: {log}\n  rerun the same command: finished tasks are kept, "
                "unfinished ones are redone"
            ) from None


class _SlurmExecutor(SlurmPipelineExecutor):
    def launch_merge_stats(self):
        """Not submitted: it waits on every task (afterok), so after a failed task it would stay
        queued forever; longctx merges the tasks' results itself."""


def run_local(pipeline: list, tasks: int, workers: int, logging_dir: Path, quiet: bool) -> None:
    executor = _LocalExecutor(
        pipeline,
        tasks=tasks,
        workers=workers,
        logging_dir=str(logging_dir),
        start_method="fork",  # workers inherit the imported modules: no re-import per task
    )
    run = executor.run if workers > 1 else partial(_run_in_process, executor)
    with _forks_end_on_sigterm():
        if not quiet:
            run()
            return
        logger.remove()  # the task logs still go to their files; only the console copy is dropped
        try:
            # forked tasks log to the StringIO, not the console
            with contextlib.redirect_stderr(io.StringIO()):
                run()
        finally:
            setup_default_logger()


@contextlib.contextmanager
def _forks_end_on_sigterm():
    """SIGTERM's default action while the pool forks. Its workers inherit the handlers, and
    Pool.terminate ends them with SIGTERM: a Python handler (a fit's SaveOnSignal, when train.py
    prepares the embedded corpus on first use; a notebook's) catches it instead and the pool
    waits on them forever. The parent has nothing to save before its data exists."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers: a pool started elsewhere keeps them
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_in_process(executor: LocalPipelineExecutor) -> None:
    """datatrove's run() for one worker, without the process Manager it starts for its pool
    (a forked process that stays up for the whole run: 0.3-0.4 s of a 1.5 s prepare here)."""
    pipeline = executor.pipeline
    for rank in executor.get_incomplete_ranks():
        executor.pipeline = deepcopy(pipeline)  # as datatrove does: fresh stats per task
        executor._run_for_rank(rank)


def run_slurm(pipeline: list, tasks: int, logging_dir: Path, options: SlurmOptions) -> None:
    """Submit the incomplete tasks as a job array, wait for it, and name what did not finish."""
    executor = _SlurmExecutor(
        pipeline,
        tasks=tasks,
        time=options.time,
        partition=options.partition,
        cpus_per_task=options.cpus_per_task,
        mem_per_cpu_gb=options.mem_per_cpu_gb,
        qos=options.qos or "",
        job_name=options.job_name,
        logging_dir=str(logging_dir),
        # the job runs this Python's datatrove entry point; PYTHONPATH travels with the job
        env_command=f"export PATH={Path(sys.executable).parent}:$PATH",
    )
    executor.run()
    if executor.job_id in (None, -1):  # every task had completed already
        return
    _wait_for_job(str(executor.job_id), options.poll_seconds)
    missing = executor.get_incomplete_ranks()
    if missing:
        ranks = json.loads(Path(logging_dir, "ranks_to_run.json").read_text())
        raise PrepareTaskFailed(_slurm_failure(missing, ranks, executor, logging_dir))


def check_slurm_reachable(partition: str) -> None:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        raise SlurmUnreachable(
            "--executor slurm: no SLURM reachable here (sbatch/sinfo are not on PATH); expected "
            "a SLURM login node, or --executor local"
        )
    proc = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmUnreachable(
            f"--executor slurm: no SLURM reachable here (sinfo failed: "
            f"{proc.stderr.strip()[-300:]}); expected a running SLURM, or --executor local"
        )
    partitions = sorted(set(proc.stdout.split()))
    if partition not in partitions:
        raise LongctxError(
            f"--partition {partition!r}: no such SLURM partition; sinfo lists {partitions}"
        )


def _wait_for_job(job_id: str, poll_seconds: float) -> None:
    """Until no element of the array is pending or running (squeue forgets finished jobs)."""
    while True:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
        )
        if proc.returncode != 0 or not proc.stdout.strip():
            return
        time.sleep(poll_seconds)


def _slurm_failure(missing: list[int], ranks: list[int], executor, logging_dir: Path) -> str:
    lines = [
        f"{len(missing)} of {executor.tasks} prepare tasks did not finish (SLURM job {executor.job_id}):"
    ]
    for rank in missing:
        slurm_log = Path(executor.slurm_logs_folder) / f"{executor.job_id}_{ranks.index(rank)}.out"
        task_log = Path(logging_dir) / "logs" / f"task_{rank:05d}.log"
        lines.append(f"  task {rank}: {_last_error(slurm_log)}\n    logs: {slurm_log}, {task_log}")
    lines.append("rerun the same command: finished tasks are kept, only these are redone")
    return "\n".join(lines)


def _last_error(path: Path) -> str:
    """The task's last Python error line in its SLURM log (srun prefixes lines with '0: ')."""
    if not path.is_file():
        return "never started (no SLURM log)"
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [
        line.split(": ", 1)[1] if line[:1].isdigit() else line
        for line in lines
        if re.search(r"\w+(Error|Exception|Interrupt)\b", line) and not line.startswith("srun:")
    ]
    return (errors or lines or ["(empty SLURM log)"])[-1][-300:]
