"""The associative-recall study's report: accuracy per arm x condition x distance, with the
hierarchical seed-paired bootstrap and, beside it, a seed-level t interval; the masked pair's
per-instance agreement; a figure of accuracy against distance per arm.

    python -m studies.recall_report SCORES_DIR --out DIR [--swapped SWAPPED_DIR]

SCORES_DIR holds one ``<run>.csv`` per run (python -m studies.recall); SWAPPED_DIR the masked
runs read under the other position ids (``--positions swapped``), compared per instance with
their own reading: the masked pair with the same weights. Writes
``recall.json``, ``recall_instances.csv.gz`` (every run's per-instance rows), ``recall_seeds.csv``
(per-seed accuracies) and ``recall.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from longctx.cli import command
from longctx.errors import LongctxError
from longctx.io import atomic_write_bytes
from studies.recall_conditions import CONDITIONS
from studies.statistics import (
    arm_sample,
    difference,
    estimate,
    seed_level,
    write_per_instance,
)
from studies.sweep_files import read_table

N_BOOT = 2000
ARMS = {  # (document_mask, reset_position_ids) -> name
    (True, True): "masked, reset",
    (True, False): "masked, continuous",
    (False, True): "unmasked, reset",
    (False, False): "unmasked, continuous",
}
# the differences the study reads: what dropping the mask costs under each position choice, and
# the masked pair (the rounding control)
DIFFERENCES = [
    ("unmasked, continuous", "masked, continuous"),
    ("unmasked, reset", "masked, reset"),
    ("masked, continuous", "masked, reset"),
    ("unmasked, continuous", "unmasked, reset"),
]
INSTANCE = ["row", "query"]
NUMERIC = ("seed", "row", "query", "distance", "prediction", "correct")
TEXT = ("document_mask", "reset_position_ids", "condition", "target_distance")  # blank: no length


def read_scores(folder: Path):
    import pandas as pd

    files = sorted(Path(folder).glob("*.csv"))
    if not files:
        raise LongctxError(f"{folder} holds no <run>.csv; expected python -m studies.recall's")
    frames = []
    for f in files:
        frame = read_table(f, numeric=NUMERIC, text=TEXT)
        if not np.isin(frame["correct"], (0, 1)).all():
            raise LongctxError(f"{f}: column 'correct' holds values other than 0 and 1")
        frames.append(frame.assign(run=f.stem))
    frame = pd.concat(frames, ignore_index=True)
    frame["arm"] = [ARMS[(bool(m), bool(r))] for m, r in
                    zip(frame["document_mask"], frame["reset_position_ids"], strict=True)]  # fmt: skip
    target = pd.to_numeric(frame["target_distance"], errors="coerce").astype("Int64")
    frame["target_distance"] = target
    frame["cell"] = [
        c if pd.isna(d) else f"{c}@{d}" for c, d in zip(frame["condition"], target, strict=True)
    ]
    return frame


def cell_report(frame, rng) -> dict:
    """One condition cell: each arm's accuracy and the differences, both intervals."""
    samples = {arm: arm_sample(g, "correct", None, INSTANCE) for arm, g in frame.groupby("arm")}
    arms = {
        arm: {**estimate(s, N_BOOT, rng), "seed_level": seed_level(list(s.per_seed().values())),
              "per_seed": s.per_seed()}
        for arm, s in samples.items()
    }  # fmt: skip
    diffs = {}
    for a, b in DIFFERENCES:
        common = set(samples[a].seeds) & set(samples[b].seeds) if {a, b} <= set(samples) else ()
        if len(common) >= 2:
            # paired by seed, over the seeds both arms have (a study split over sessions);
            # difference() carries the seed-level interval beside the bootstrap
            pair = frame[frame["seed"].isin(common)]
            first, second = (arm_sample(pair[pair["arm"] == arm], "correct", None, INSTANCE)
                             for arm in (a, b))  # fmt: skip
            diffs[f"{a} - {b}"] = difference(first, second, N_BOOT, rng)
    return {"arms": arms, "differences": diffs}


def masked_pair_agreement(frame) -> dict:
    """Per instance and seed, whether the two masked arms predict the same token."""
    pair = frame[frame["document_mask"].astype(bool)]
    wide = pair.pivot_table(index=["seed", "cell", "row", "query"], columns="arm",
                            values="prediction", aggfunc="first")  # fmt: skip
    if wide.shape[1] != 2:
        return {}
    wide = wide.dropna()
    same = (wide.iloc[:, 0] == wide.iloc[:, 1]).to_numpy()
    return {"instances": int(len(same)), "agree": int(same.sum()),
            "fraction": float(same.mean()) if len(same) else None}  # fmt: skip


def same_weights_agreement(frame, swapped) -> dict:
    """Per masked run read under both position ids: instances, how many predict the same token,
    and the accuracy each way."""
    key = ["run", "cell", "row", "query"]
    if not swapped["document_mask"].astype(bool).all():
        raise LongctxError("--swapped holds an unmasked run; expected masked runs only")
    both = frame.merge(swapped, on=key, suffixes=("", "_swapped"), validate="one_to_one")
    missing = set(swapped["run"]) - set(both["run"])
    if missing or len(both) != len(swapped):
        raise LongctxError(f"--swapped: runs {sorted(missing)} or instances not in the scores")
    out = {}
    for run, g in [*both.groupby("run"), ("all", both)]:
        out[run] = {"instances": len(g), "agree": int((g["prediction"] == g["prediction_swapped"]).sum()),
                    "accuracy": float(g["correct"].mean()),
                    "accuracy_swapped": float(g["correct_swapped"].mean())}  # fmt: skip
    return out


def report(frame, swapped=None) -> dict:
    rng = np.random.default_rng(0)
    cells = sorted(frame["cell"].unique(), key=_cell_order)
    return {
        "seeds": sorted(int(s) for s in frame["seed"].unique()),
        "runs": sorted(frame["run"].unique().tolist()),
        "cells": {c: cell_report(frame[frame["cell"] == c], rng) for c in cells},
        "masked_pair_agreement": masked_pair_agreement(frame),
        **({} if swapped is None else
           {"masked_pair_same_weights": same_weights_agreement(frame, swapped)}),
    }  # fmt: skip


def _cell_order(cell: str):
    condition, _, distance = cell.partition("@")
    return (CONDITIONS.index(condition), int(distance or 0))


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lengths = [c for c in result["cells"] if c.startswith("length@")]
    distances = [int(c.split("@")[1]) for c in lengths]
    for arm in ARMS.values():
        cells = [result["cells"][c]["arms"].get(arm) for c in lengths]
        if not all(cells):
            continue
        y = [c["value"] for c in cells]
        err = np.array([[c["value"] - c["ci"][0], c["ci"][1] - c["value"]] for c in cells]).T
        ax.errorbar(distances, y, yerr=err, marker="o", capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance from key to query (tokens; first query of a length document)")
    ax.set_ylabel("answer accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("MQAR recall against distance, by arm (95% hierarchical bootstrap)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m studies.recall_report",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("scores", help="folder of per-run CSVs")
    parser.add_argument("--out", required=True)
    parser.add_argument("--swapped", default=None, help="folder of masked runs read swapped")
    args = parser.parse_args(argv)
    frame = read_scores(Path(args.scores))
    swapped = None if args.swapped is None else read_scores(Path(args.swapped))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = report(frame, swapped)
    atomic_write_bytes(out / "recall.json", (json.dumps(result, indent=1) + "\n").encode())
    write_per_instance(frame.drop(columns=["cell", "arm"]), out / "recall_instances.csv.gz")
    seeds = frame.groupby(["arm", "cell", "seed"])["correct"].mean().reset_index()
    atomic_write_bytes(out / "recall_seeds.csv", seeds.to_csv(index=False).encode())
    figure(result, out / "recall.png")
    for cell, body in result["cells"].items():
        line = ", ".join(f"{a} {v['value']:.3f}" for a, v in body["arms"].items())
        print(f"{cell}: {line}")


cli = command(main)

if __name__ == "__main__":
    cli()
