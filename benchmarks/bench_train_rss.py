"""Does the CPU capacity plan hold for train.py? The dry run's peak against one real step's RSS.

For each row length L: ``train.py dry_run=true`` prints the plan (its runtime baseline is the
dry-run process's own RSS, its "retained heap" term the allowance
``longctx.planner.CPU_HEAP_RETENTION``), then ``train.py`` trains ``--steps`` steps of the tiny
model on the embedded corpus (micro-batch 1, no validation) and its peak RSS is read
(ru_maxrss of the finished child). "fraction" is what the allowance would have to be for this
length: (measured - plan without the allowance) / the step tensors' peak.

    nice -n 10 .venv/bin/python benchmarks/bench_train_rss.py --lengths 16384 32768
    nice -n 10 .venv/bin/python benchmarks/bench_train_rss.py --lengths 65536   # ~8 GiB, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longctx.planner import CPU_HEAP_RETENTION

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_rss.json"
GIB = 2**30
TARGET = 0.20  # |predicted / measured - 1| the issue asks for (#29)


def train_py(args: list[str], root: Path) -> tuple[str, int]:
    """(stdout, peak RSS in bytes) of one train.py process (os.wait4: that child's own rusage)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"paths.root_dir={root}"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-4000:]}")
    return text, usage.ru_maxrss * 1024  # Linux reports KiB


def gib_of(line_name: str, text: str) -> float:
    found = re.search(rf"{re.escape(line_name)}\s+([\d.,]+) GiB", text)
    if found is None:
        raise ValueError(f"no {line_name!r} line in the plan:\n{text}")
    return float(found[1].replace(",", ""))


def measure(length: int, steps: int, root: Path) -> dict:
    common = [
        f"data.seq_len={length}", "data.micro_batch_size=1", "logger=csv",
        f"paths.cache_dir={ROOT / 'data_cache'}",
    ]  # fmt: skip
    plan, _ = train_py([*common, "dry_run=true", f"run_name=plan{length}"], root)
    predicted = gib_of("peak: held + the largest backward phase", plan)
    retained = gib_of("retained heap (glibc, freed blocks kept)", plan)
    tensors = retained / float(re.search(r"([\d.]+) x the step tensors' peak", plan)[1])
    start = time.perf_counter()
    _, peak = train_py(
        [*common, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
         "trainer.enable_progress_bar=false", f"run_name=train{length}"],
        root,
    )  # fmt: skip
    measured = peak / GIB
    return {
        "L": length,
        "steps": steps,
        "wall_s": time.perf_counter() - start,
        "measured_gib": measured,
        "predicted_gib": predicted,
        "predicted_without_allowance_gib": predicted - retained,
        "step_tensors_peak_gib": tensors,
        "ratio": predicted / measured,
        "ratio_without_allowance": (predicted - retained) / measured,
        "fraction": (measured - (predicted - retained)) / tensors,
        "allowance": CPU_HEAP_RETENTION,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for length in args.lengths:
            rows.append(measure(length, args.steps, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| L | steps | plan GiB | plan w/o allowance | train.py peak RSS GiB | plan / RSS | fraction |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['L']:,} | {r['steps']} | {r['predicted_gib']:.3f} | "
            f"{r['predicted_without_allowance_gib']:.3f} | {r['measured_gib']:.3f} | "
            f"{r['ratio']:.3f} | {r['fraction']:.3f} |"
        )
    old = json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else []
    kept = [r for r in old if (r["L"], r["steps"]) not in {(n["L"], n["steps"]) for n in rows}]
    meta = {
        "measured": "peak RSS (ru_maxrss) of train.py, tiny model, micro-batch 1, no validation",
        "predicted": "train.py dry_run=true peak (its baseline: the dry-run process's RSS)",
        "target": TARGET,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    RESULTS.write_text(
        json.dumps({"meta": meta, "rows": sorted(kept + rows, key=lambda r: r["L"])}, indent=1)
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
