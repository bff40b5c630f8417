"""python -m studies.extension_report SWEEP: the context-extension recipe's table and figure.

SWEEP is the multirun folder of ``experiment=context_extension``; each arm's evaluation
(``python -m longctx.eval <arm>/checkpoints/last.ckpt``, written to ``<arm>/eval``) gives the loss
on the long held-out documents per octave ending at 1x, 2x and 4x the arm's length, and passkey
accuracy by length. Prints a Markdown table, and each arm's paired difference from the
``unchanged`` arm per octave with a 95% bootstrap interval over the held-out documents (the
same documents scored by both arms); writes both to ``--json`` and draws the per-position curves
of every arm to ``--out``. SWEEP may hold several training seeds' sweeps: the intervals then come
from the hierarchical bootstrap of studies.statistics (seeds, then documents within
each; paired by seed with ``unchanged``, whose seed s continued the same stage 1); with one seed
they cover document sampling only. Beside each bootstrap interval: the seed-level t interval over
the per-seed differences and their signs (``seed_level``), which few seeds make the wider one. Beside the JSON: the per-document octave losses
(``_instances.csv.gz``).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from longctx.cli import command
from longctx.errors import LongctxError
from longctx.eval.files import (
    EVAL_DIR,
    EVAL_SUMMARY_JSON,
    LONG_DOCUMENT_OCTAVES_CSV,
    LONG_DOCUMENTS_CSV,
)
from longctx.eval.long_documents import octave_starts
from studies import statistics as st
from studies.sweep_files import read_json_file, read_table

ARM_KEY = "rope_arm="
BASELINE = "unchanged"
MULTIPLES = (1, 2, 4)


def arm_name(folder: Path) -> str:
    """The rope_arm choice in a sweep subfolder's name (``rope_arm=abf,trainer...`` -> abf)."""
    for part in folder.name.split(","):
        if part.startswith(ARM_KEY):
            return part[len(ARM_KEY) :]
    raise LongctxError(f"{folder} is not a context_extension arm (no {ARM_KEY}... in its name)")


def arm_results(folder: Path) -> dict:
    summary_path = folder / EVAL_DIR / EVAL_SUMMARY_JSON
    if not summary_path.is_file():
        raise FileNotFoundError(
            f"{summary_path} is missing; run python -m longctx.eval "
            f"{folder}/checkpoints/last.ckpt first"
        )
    summary = read_json_file(summary_path, "an eval summary (eval.json)")
    row = {"arm": arm_name(folder), "seq_len": summary["seq_len"]}
    row |= {f"loss_{r['multiple']}x": r["loss"] for r in summary["long_documents"]}
    for cell in pd.DataFrame(summary.get("passkey", [])).groupby("length", as_index=False):
        length, table = cell
        row[f"passkey_{length}"] = float(table["accuracy"].mean())
    return row


def octave_sums(folder: Path, seq_len: int, multiple: int) -> pd.DataFrame:
    """Per document: the loss sum over the octave [m L/2, m L) and its tokens, as the arm's
    evaluation scored them (longctx.eval.long_documents.octave_starts)."""
    records = read_table(folder / EVAL_DIR / LONG_DOCUMENT_OCTAVES_CSV, text=["doc"],
                         numeric=["bucket_start", "loss_sum", "tokens"])  # fmt: skip
    octave = records[records["bucket_start"] == octave_starts(seq_len, multiple)[-1]]
    return octave.groupby("doc")[["loss_sum", "tokens"]].sum()


def octave_sample(folders: dict[int, Path], seq_len: int, multiple: int) -> st.ArmSample:
    """One arm's octave loss sums over tokens, [training seeds, documents]."""
    frames = [octave_sums(f, seq_len, multiple).reset_index().assign(seed=seed)
              for seed, f in folders.items()]  # fmt: skip
    return st.arm_sample(pd.concat(frames), "loss_sum", "tokens", ["doc"])


def paired_differences(
    runs: dict[str, dict[int, Path] | Path], seq_len: int, n_boot: int = 10_000, seed: int = 0
) -> list[dict]:
    """Each arm minus the unchanged-RoPE arm per octave, over the same documents and, where the
    arms share their training seeds (stage 2 of seed s continues stage 1 of seed s), paired by
    seed (the hierarchical bootstrap of studies.statistics). ``runs``: arm ->
    {training seed: run folder} (a folder alone: one seed)."""
    runs = {arm: f if isinstance(f, dict) else {0: f} for arm, f in runs.items()}
    if BASELINE not in runs:
        return []
    rng = np.random.default_rng(seed)
    rows = []
    for multiple in MULTIPLES:
        base = octave_sample(runs[BASELINE], seq_len, multiple)
        for arm, folders in runs.items():
            if arm == BASELINE:
                continue
            other = octave_sample(folders, seq_len, multiple)
            if other.instances != base.instances or not np.array_equal(
                other.weights[0], base.weights[0]
            ):
                raise LongctxError(
                    f"{arm} ({sorted(map(str, folders.values()))[0]}): its long documents are "
                    f"not {BASELINE}'s; re-evaluate"
                )
            row = st.difference(other, base, n_boot, rng, st.shares_seeds(other, base))
            rows.append({"arm": arm, "multiple": multiple, "delta": row["delta"],
                         "ci95": row["ci"], "paired": row["paired"], "seeds": row["seeds"],
                         "seed_level": row["seed_level"],
                         "documents": len(base.instances)})  # fmt: skip
    return rows


def differences_markdown(rows: Sequence[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    header = [f"{m}x" for m in MULTIPLES]
    lines = [f"| arm - {BASELINE} | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for arm in arms:
        cells = [
            f"{r['delta']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]; seed-level "
            f"{st.seed_level_text(r, '+.3f')}"
            for r in rows
            if r["arm"] == arm
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: Sequence[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(arms: dict[str, pd.DataFrame], seq_len: int, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, data in arms.items():
        data = data[data["bucket_start"] > 0]  # position 0 has no context (and no log2 place)
        ax.plot(data["bucket_start"], data["loss"], marker="o", label=name)
    ax.axvline(seq_len, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in document (bucket [p, 2p); dotted: the training length)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def arm_runs(root: Path) -> list[tuple[str, int, Path]]:
    """(arm, training seed, folder) of every context_extension arm under ``root``: one sweep
    folder, or a folder of several seeds' sweeps (seed<S>/multirun/train/<time>/rope_arm=...)."""
    from studies.sweep_files import find_runs, run_settings

    found = [f for f in find_runs(root) if ARM_KEY in f.name]
    if not found:
        raise FileNotFoundError(
            f"{root} holds no rope_arm=... run folders; expected the multirun folder of "
            "experiment=context_extension (or a folder of several seeds' sweeps)"
        )
    return [(arm_name(f), int(run_settings(f)["run"].get("seed", 0)), f) for f in found]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m studies.extension_report")
    p.add_argument("sweep", type=Path,
                   help="the multirun folder of experiment=context_extension, or a folder of "
                        "several seeds' sweeps")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="figure (default: SWEEP/extension.png)")
    p.add_argument("--json", type=Path, default=None, help="table + notes (SWEEP/extension.json)")
    p.add_argument("--note", default="", help="a line for the figure title and the JSON")
    args = p.parse_args(argv)
    found = arm_runs(args.sweep)
    rows = [{**arm_results(f), "seed": seed} for _, seed, f in found]
    seq_len = rows[0]["seq_len"]
    runs: dict[str, dict[int, Path]] = {}
    for arm, seed, folder in found:
        runs.setdefault(arm, {})[seed] = folder
    plot({arm: pooled_curve(list(by_seed.values())) for arm, by_seed in runs.items()}, seq_len,
         args.out or args.sweep / "extension.png",
         f"long held-out documents, per position; {args.note}")  # fmt: skip
    differences = paired_differences(runs, seq_len)
    table = markdown(rows)
    if differences:
        table += "\n\n" + differences_markdown(differences)
    print(table)
    path = args.json or args.sweep / "extension.json"
    report = {"note": args.note, "arms": rows, "differences": differences, "markdown": table}
    path.write_text(json.dumps(report, indent=2) + "\n")
    write_per_document(runs, seq_len, path)
    return rows


def pooled_curve(folders: list[Path]) -> pd.DataFrame:
    """The arm's per-position curve over all its seeds' documents."""
    records = pd.concat([read_table(f / EVAL_DIR / LONG_DOCUMENTS_CSV,
                                    numeric=["bucket_start", "loss_sum", "tokens"])
                         for f in folders])  # fmt: skip
    sums = records.groupby("bucket_start")[["loss_sum", "tokens"]].sum()
    return (sums["loss_sum"] / sums["tokens"]).rename("loss").reset_index()


def write_per_document(runs: dict[str, dict[int, Path]], seq_len: int, path: Path) -> Path:
    """Beside the JSON: per arm, seed, octave and document, the loss sum and tokens (what the
    differences are recomputed from)."""
    frames = [octave_sums(f, seq_len, m).reset_index().assign(arm=arm, seed=seed, multiple=m)
              for arm, by_seed in runs.items() for seed, f in by_seed.items()
              for m in MULTIPLES]  # fmt: skip
    out = path.with_name(path.stem + "_instances.csv.gz")
    st.write_per_instance(pd.concat(frames, ignore_index=True), out)
    return out


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
