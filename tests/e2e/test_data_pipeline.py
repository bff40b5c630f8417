"""prepare as a datatrove pipeline: any task count gives the same documents in input order; a
failed task is named with its log and is the only one a rerun redoes; on the local SLURM,
4 tasks equal the single-process run and a killed task is redone alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture: start the cluster or skip)

from longctx.data.pipeline import check_slurm_reachable
from longctx.data.prepare import PrepareTaskFailed, SlurmOptions, cli, main, prepare
from longctx.data.shards import MANIFEST_NAME, ShardSet, load_manifest
from longctx.data.sources import describe_source, documents_of_task, is_validation
from longctx.data.tokenizer import ByteTokenizer


def mixed_inputs(folder: Path, scale: int = 1) -> list[Path]:
    """JSONL (blank lines, CRLF, some ids), Parquet in 3 row groups, text files, an empty one."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(40 * scale):
        record = {"text": f"line {i} " + "abc é " * (i % 9)}
        if i % 7 == 0:
            record["id"] = f"doc-{i}"
        lines.append(json.dumps(record) + ("\r\n" if i % 5 == 0 else "\n"))
        if i % 11 == 0:
            lines.append("\n")
    (folder / "a.jsonl").write_text("".join(lines))
    texts = [f"row {i} " * (i + 1) for i in range(15)]
    pq.write_table(pa.table({"text": texts}), folder / "b.parquet", row_group_size=5)
    (folder / "c.txt").write_text("a whole text file\nwith two lines\n")
    (folder / "d.txt").write_text("")
    (folder / "e.txt").write_text("another file ✓")
    return sorted(folder.iterdir())


def read_in_order(files: list[Path]) -> list[tuple[str, str]]:
    """(source id, text) of every document, one whole file after another: the reference."""
    from longctx.data.sources import read_documents

    return [doc for f in files for doc in read_documents(describe_source(f))]


def documents(folder: Path, split: str) -> list[np.ndarray]:
    shards = ShardSet(folder, split)
    return [shards.document(i) for i in range(shards.num_documents)]


def expected(files: list[Path], val_fraction: float) -> dict[str, list[np.ndarray]]:
    tok, out = ByteTokenizer(), {"train": [], "val": []}
    for source_id, text in read_in_order(files):
        if text:
            split = "val" if is_validation(source_id, val_fraction) else "train"
            out[split].append(np.append(tok.encode(text), tok.eos_id))
    return out


def assert_same_documents(folder: Path, want: dict[str, list[np.ndarray]]) -> None:
    for split in ("train", "val"):
        got = documents(folder, split)
        assert len(got) == len(want[split]), split
        for a, b in zip(got, want[split], strict=True):
            np.testing.assert_array_equal(a, b)


def test_task_slices_cover_every_document_once_in_order(tmp_path):
    files = mixed_inputs(tmp_path / "in")
    sources = [describe_source(f) for f in files]
    reference = read_in_order(files)
    assert len(reference) == 40 + 15 + 3
    for tasks in range(1, 60, 3):  # more tasks than units too: some slices are empty
        laid_end_to_end = [d for k in range(tasks) for d in documents_of_task(sources, k, tasks)]
        assert laid_end_to_end == reference, tasks


@pytest.mark.parametrize("tasks, workers", [(1, 1), (2, 2), (5, 2)])
def test_any_task_count_gives_the_same_documents_in_order(tmp_path, tasks, workers):
    files = mixed_inputs(tmp_path / "in")
    out = tmp_path / "out"
    m = prepare(files, out, tasks=tasks, workers=workers, val_fraction=0.2, progress=False)
    assert_same_documents(out, expected(files, 0.2))
    assert m.skipped_empty_documents == 1  # d.txt
    assert {s.tokens_file.split("-")[1] for s in m.splits["train"].shards} <= {
        f"{k:05d}" for k in range(tasks)
    }
    again = prepare(files, out, tasks=3, val_fraction=0.2, progress=False)  # no-op rerun
    assert again == m


class FlakyByte(ByteTokenizer):
    """Fails on a 'poison' document while ``flag`` exists; the spec is the byte tokenizer's."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def encode(self, text):
        if "poison" in text and self.flag.exists():
            raise ValueError("poisoned document")
        return super().encode(text)


def test_a_pool_forked_under_a_sigterm_handler_still_ends(tmp_path):
    """A process that catches SIGTERM (train.py's SaveOnSignal, when it prepares the embedded
    corpus on first use) prepares with a pool of workers: Pool.terminate's SIGTERM ends them,
    and the process gets its handler back."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    script = textwrap.dedent(f"""
        import signal
        from longctx.data.prepare import prepare
        ignore = lambda *args: print("caught", flush=True)
        signal.signal(signal.SIGTERM, ignore)
        prepare([{str(src)!r}], {str(tmp_path / "out")!r}, tasks=2, workers=2, val_fraction=0.0,
                progress=False)
        assert signal.getsignal(signal.SIGTERM) is ignore
        print("prepared", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.split() == ["prepared"], proc.stderr[-2000:]


# 90 short documents: 1% of them draws no validation split, which prepare refuses
NO_VAL = {"val_fraction": 0.0, "progress": False}


def test_failed_task_is_named_with_its_log_and_rerun_alone(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for name in "abc":  # equal files: task k of 3 reads file k
        body = "poison " if name == "b" else "benign "  # same length: equal files
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{body}{name}{j:03d}"}) + "\n" for j in range(30))
        )
    flag = tmp_path / "flag"
    flag.touch()
    out = tmp_path / "out"
    with pytest.raises(
        PrepareTaskFailed, match="prepare task 1 of 3 failed: ValueError: poison"
    ) as err:
        prepare([folder / "*.jsonl"], out, FlakyByte(flag), tasks=3, workers=1, **NO_VAL)
    log = Path(str(err.value).split("its log: ")[1].split("\n")[0])
    assert log.is_file() and "poisoned document" in log.read_text()
    assert not (out / MANIFEST_NAME).exists()
    task0 = {p.name: p.stat().st_mtime_ns for p in out.glob("*-00000-*.npy")}
    assert task0  # task 0 finished before task 1 failed
    flag.unlink()
    time.sleep(0.01)
    m = prepare([folder / "*.jsonl"], out, FlakyByte(flag), tasks=3, workers=1, **NO_VAL)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*-00000-*.npy")} == task0
    assert m.splits["train"].documents + m.splits["val"].documents == 90
    clean = tmp_path / "clean"
    prepare([folder / "*.jsonl"], clean, tasks=1, **NO_VAL)
    for split in ("train", "val"):
        assert [d.tolist() for d in documents(out, split)] == [
            d.tolist() for d in documents(clean, split)
        ]


def test_slurm_executor_with_no_slurm_reachable(tmp_path, monkeypatch, capsys):
    src = tmp_path / "d.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no srun/sbatch/sinfo
    options = SlurmOptions(partition="debug")
    with pytest.raises(
        RuntimeError, match=r"no SLURM reachable here \(sbatch/sinfo are not on PATH"
    ):
        prepare([src], tmp_path / "out", executor="slurm", slurm=options, progress=False)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    for name, body in (
        ("sbatch", "exit 0"),
        ("sinfo", "echo 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1"),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    with pytest.raises(
        RuntimeError, match="sinfo failed: slurm_load_partitions: Unable to contact"
    ):
        check_slurm_reachable("debug")
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho debug\necho debug\n")
    with pytest.raises(
        ValueError, match=r"--partition 'gpu': no such SLURM partition; sinfo lists \['debug'\]"
    ):
        check_slurm_reachable("gpu")
    with pytest.raises(SystemExit):
        main([str(src), "--out", str(tmp_path / "o"), "--executor", "slurm"])  # no --partition
    (bin_dir / "sinfo").unlink()
    capsys.readouterr()  # argparse's usage above
    with pytest.raises(SystemExit) as stop:
        cli([str(src), "--out", str(tmp_path / "o"), "--executor", "slurm", "--partition", "x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --executor slurm: no SLURM reachable here")


# ------------------------------------------------------------------ on the local SLURM
SLOW_PREPARE = """
import sys
from longctx.data.prepare import SlurmOptions, prepare
from longctx.data.tokenizer import ByteTokenizer

class SlowByte(ByteTokenizer):  # same spec as 'byte': reruns and the local run share a hash
    def __init__(self, sleep_s):
        self.sleep_s = sleep_s

    def encode(self, text):
        import time  # the class travels to the SLURM job by value; this module's globals do not

        time.sleep(self.sleep_s)
        return super().encode(text)

inputs, out, job_name = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
prepare(inputs, out, SlowByte(float(sys.argv[4])), tasks=4, executor="slurm", val_fraction=0.2,
        slurm=SlurmOptions("debug", time="00:10:00", job_name=job_name, poll_seconds=0.5))
"""


def run_on_slurm(files, out, job_name, sleep_s, timeout=420) -> subprocess.Popen:
    cmd = [sys.executable, "-c", textwrap.dedent(SLOW_PREPARE), ",".join(map(str, files))]
    return subprocess.Popen(
        [*cmd, str(out), job_name, str(sleep_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finish(proc: subprocess.Popen, job_name: str, timeout: float = 420) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        subprocess.run(["scancel", "-n", job_name], timeout=30)  # nothing left queued
    return proc.returncode, out


def work_dir(out: Path) -> Path:
    (work,) = (out / ".longctx-work").iterdir()
    return work


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_four_slurm_tasks_equal_the_single_process_run(tmp_path):
    files = mixed_inputs(tmp_path / "in")
    local = tmp_path / "local"
    prepare(files, local, tasks=1, workers=1, val_fraction=0.2, progress=False)
    job = f"longctx-test-{os.getpid()}-equal"
    rc, log = finish(run_on_slurm(files, tmp_path / "slurm", job, 0.0), job)
    assert rc == 0, log[-3000:]
    manifest = load_manifest(tmp_path / "slurm")
    assert {s.tokens_file.split("-")[1] for s in manifest.splits["train"].shards} == {
        f"{k:05d}" for k in range(4)
    }  # every task wrote its own shards
    for split in ("train", "val"):
        assert [d.tolist() for d in documents(tmp_path / "slurm", split)] == [
            d.tolist() for d in documents(local, split)
        ]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.usefixtures("slurm_cluster")
def test_killed_slurm_task_is_named_and_the_rerun_redoes_only_it(tmp_path):
    files = mixed_inputs(tmp_path / "in", scale=4)  # 160 + 18 documents, 4 tasks
    out = tmp_path / "slurm"
    job = f"longctx-test-{os.getpid()}-kill"
    proc = run_on_slurm(files, out, job, 0.05)
    try:
        deadline = time.time() + 300
        while not list(out.glob(".longctx-work/*/datatrove/logs/task_00002.log")):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        slurm_logs = work_dir(out) / "datatrove" / "slurm_logs"
        (array_job,) = {p.name.split("_")[0] for p in slurm_logs.glob("*_2.out")}
        subprocess.run(["scancel", f"{array_job}_2"], check=True, timeout=30)
    finally:
        rc, log = finish(proc, job)
    assert rc != 0
    assert "1 of 4 prepare tasks did not finish" in log and "task 2:" in log, log[-3000:]
    assert f"{slurm_logs / f'{array_job}_2.out'}" in log
    assert not (out / MANIFEST_NAME).exists()
    results = work_dir(out) / "results"
    kept = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    assert sorted(kept) == ["00000.json", "00001.json", "00003.json"]
    rc, log = finish(run_on_slurm(files, out, job, 0.0), job)
    assert rc == 0, log[-3000:]
    assert json.loads((work_dir(out) / "datatrove" / "ranks_to_run.json").read_text()) == [2]
    assert {
        n: t for n, t in ((p.name, p.stat().st_mtime_ns) for p in results.iterdir()) if n in kept
    } == kept
    local = tmp_path / "local"
    prepare(files, local, tasks=1, workers=1, val_fraction=0.2, progress=False)
    for split in ("train", "val"):
        assert [d.tolist() for d in documents(out, split)] == [
            d.tolist() for d in documents(local, split)
        ]
