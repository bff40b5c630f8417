"""python -m longctx.experiments.extension_report SWEEP: the context-extension recipe's table and figure.

SWEEP is the multirun folder of ``experiment=context_extension``; each arm's evaluation
(``python -m longctx.eval <arm>/checkpoints/last.ckpt``, written to ``<arm>/eval``) gives the loss
on the long held-out documents per octave ending at 1x, 2x and 4x the arm's length, and passkey
accuracy by length. Prints a Markdown table, and each arm's paired difference from the
``unchanged`` arm per octave with a 95% bootstrap interval over the held-out documents (the
same documents scored by both arms); writes both to ``--json`` and draws the per-position curves
of every arm to ``--out``. The intervals cover document sampling only: one training seed per arm
(see longctx.experiments.ablation for the training-noise floor of a run this size).
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
from longctx.eval.long_documents import octave_starts
from longctx.experiments.ablation import bootstrap_difference, interval

ARM_KEY = "rope_arm="
BASELINE = "unchanged"
MULTIPLES = (1, 2, 4)


def arm_name(folder: Path) -> str:
    """The rope_arm choice in a sweep subfolder's name (``rope_arm=abf,trainer...`` -> abf)."""
    for part in folder.name.split(","):
        if part.startswith(ARM_KEY):
            return part[len(ARM_KEY) :]
    raise ValueError(f"{folder} is not a context_extension arm (no {ARM_KEY}... in its name)")


def arm_results(folder: Path) -> dict:
    summary_path = folder / "eval" / "eval.json"
    if not summary_path.is_file():
        raise FileNotFoundError(
            f"{summary_path} is missing; run python -m longctx.eval "
            f"{folder}/checkpoints/last.ckpt first"
        )
    summary = json.loads(summary_path.read_text())
    row = {"arm": arm_name(folder), "seq_len": summary["seq_len"]}
    row |= {f"loss_{r['multiple']}x": r["loss"] for r in summary["long_documents"]}
    for cell in pd.DataFrame(summary.get("passkey", [])).groupby("length", as_index=False):
        length, table = cell
        row[f"passkey_{length}"] = float(table["accuracy"].mean())
    return row


def curve(folder: Path) -> pd.DataFrame:
    """Token-weighted loss per log2 in-document bucket on the long held-out documents."""
    records = pd.read_csv(folder / "eval" / "long_documents.csv")
    sums = records.groupby("bucket_start")[["loss_sum", "tokens"]].sum()
    return (sums["loss_sum"] / sums["tokens"]).rename("loss").reset_index()


def octave_sums(folder: Path, seq_len: int, multiple: int) -> pd.DataFrame:
    """Per document: the loss sum over the octave [m L/2, m L) and its tokens, as the arm's
    evaluation scored them (longctx.eval.long_documents.octave_starts)."""
    records = pd.read_csv(folder / "eval" / "long_documents_by_octave.csv")
    octave = records[records["bucket_start"] == octave_starts(seq_len, multiple)[-1]]
    return octave.groupby("doc")[["loss_sum", "tokens"]].sum()


def paired_differences(
    folders: dict[str, Path], seq_len: int, n_boot: int = 10_000, seed: int = 0
) -> list[dict]:
    """Each arm minus the unchanged-RoPE arm per octave, paired over the same documents."""
    if BASELINE not in folders:
        return []
    rng = np.random.default_rng(seed)
    rows = []
    for multiple in MULTIPLES:
        base = octave_sums(folders[BASELINE], seq_len, multiple)
        for arm, folder in folders.items():
            if arm == BASELINE:
                continue
            other = octave_sums(folder, seq_len, multiple)
            if not other["tokens"].equals(base["tokens"]):
                raise ValueError(f"{folder}: its long documents are not {BASELINE}'s; re-evaluate")
            sums = other["loss_sum"].to_numpy()[None], base["loss_sum"].to_numpy()[None]
            tokens = base["tokens"].to_numpy()
            replicates = bootstrap_difference(*sums, tokens, n_boot, rng)
            delta = float((sums[0] - sums[1]).sum() / tokens.sum())
            rows.append({"arm": arm, "multiple": multiple, "delta": delta,
                         "ci95": list(interval(replicates)), "documents": len(tokens)})  # fmt: skip
    return rows


def differences_markdown(rows: Sequence[dict]) -> str:
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    header = [f"{m}x" for m in MULTIPLES]
    lines = [f"| arm - {BASELINE} | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for arm in arms:
        cells = [
            f"{r['delta']:+.3f} [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]"
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


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m longctx.experiments.extension_report")
    p.add_argument("sweep", type=Path, help="the multirun folder of experiment=context_extension")
    p.add_argument("--out", type=Path, default=None, help="figure (default: SWEEP/extension.png)")
    p.add_argument("--json", type=Path, default=None, help="table + notes (SWEEP/extension.json)")
    p.add_argument("--note", default="", help="a line for the figure title and the JSON")
    args = p.parse_args(argv)
    folders = sorted(f for f in args.sweep.iterdir() if f.is_dir() and ARM_KEY in f.name)
    if not folders:
        raise FileNotFoundError(
            f"{args.sweep} holds no rope_arm=... run folders; expected the "
            "multirun folder of experiment=context_extension"
        )
    rows = [arm_results(f) for f in folders]
    seq_len = rows[0]["seq_len"]
    plot({r["arm"]: curve(f) for r, f in zip(rows, folders, strict=True)}, seq_len,
         args.out or args.sweep / "extension.png",
         f"long held-out documents, per position; {args.note}")  # fmt: skip
    differences = paired_differences({r["arm"]: f for r, f in zip(rows, folders, strict=True)},
                                     seq_len)  # fmt: skip
    table = markdown(rows)
    if differences:
        table += "\n\n" + differences_markdown(differences)
    print(table)
    report = {"note": args.note, "arms": rows, "differences": differences, "markdown": table}
    (args.json or args.sweep / "extension.json").write_text(json.dumps(report, indent=2) + "\n")
    return rows


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
