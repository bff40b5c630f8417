"""Retrieval in the training formats, arm against arm: the exact-answer rate of runs read by
``python -m studies.ood_control``, per scored length, with the hierarchical seed-paired bootstrap
and the seed-level interval of every difference from the control arm.

    python -m studies.ood_report DIR --json OUT.json [--control "masked, reset pos"]

DIR holds ood_control's <name>.json and <name>.csv of each run (its arm, training seed and
length are in the JSON). An instance is one answer of one held-out document; arms are paired by
training seed (stage-2 seed S continues control seed S) and by answer, since every run of one
length is read on the same documents. Beside OUT.json: every answer as ``_instances.csv.gz``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from longctx.cli import command
from longctx.data.arms import ARM_ORDER, arm_label
from longctx.errors import LongctxError
from studies import statistics as st

INSTANCE = ["doc", "answer"]
ORDER = [arm_label(*arm) for arm in ARM_ORDER]


def load_answers(folder: Path) -> pd.DataFrame:
    """Every answer of every run in ``folder``, with its run's arm, seed and length."""
    frames = []
    for path in sorted(folder.glob("*.json")):
        meta = json.loads(path.read_text())
        if "arm" not in meta:
            raise LongctxError(f"{path} has no arm; expected studies.ood_control's JSON")
        rows = pd.read_csv(path.with_suffix(".csv"))
        frames.append(rows.assign(arm=meta["arm"], length=meta["length"], run=path.stem))
    if not frames:
        raise FileNotFoundError(f"no studies.ood_control JSON in {folder}")
    return pd.concat(frames, ignore_index=True)


def summarize(answers: pd.DataFrame, control: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """Per length: each arm's exact rate (and the share of answers that are another value of the
    document), and each arm's difference from ``control``."""
    rng = np.random.default_rng(seed)
    lengths = []
    for length, at in answers.groupby("length"):
        arms = sorted(at["arm"].unique(), key=ORDER.index)
        if control not in arms:
            raise LongctxError(f"--control {control!r} is not among the arms {arms} at {length}")
        samples = {a: st.arm_sample(at[at["arm"] == a], "exact", None, INSTANCE) for a in arms}
        rows = [{"arm": a, **st.estimate(s, n_boot, rng),
                 "seed_values": {str(k): v for k, v in s.per_seed().items()},  # JSON's keys
                 "other_value": float(at.loc[at["arm"] == a, "other_value"].mean())}
                for a, s in samples.items()]  # fmt: skip
        pairs = [{"a": a, "b": control, **st.difference(samples[a], samples[control], n_boot, rng)}
                 for a in arms if a != control]  # fmt: skip
        lengths.append({"length": int(length), "answers": len(samples[control].instances),
                        "arms": rows, "pairs": pairs})  # fmt: skip
    return {"control": control, "bootstrap": n_boot, "lengths": lengths}


def markdown(summary: dict) -> str:
    lines = [
        "| length | arm | exact | other value | − control | seed level |",
        "|---|---|---|---|---|---|",
    ]
    for at in summary["lengths"]:
        pairs = {p["a"]: p for p in at["pairs"]}
        for arm in at["arms"]:
            low, high = arm["ci"]
            pair = pairs.get(arm["arm"])
            delta = (
                f"{pair['delta']:+.3f} [{pair['ci'][0]:+.3f}, {pair['ci'][1]:+.3f}]" if pair else ""
            )
            level = st.seed_level_text(pair, "+.3f") if pair else ""
            lines.append(f"| {at['length']} | {arm['arm']} | {arm['value']:.3f} [{low:.3f}, {high:.3f}] "
                         f"| {arm['other_value']:.3f} | {delta} | {level} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m studies.ood_report", description=__doc__.split("\n")[0]
    )
    p.add_argument("folder", type=Path, help="studies.ood_control's output folder")
    p.add_argument("--json", type=Path, required=True, help="the summary JSON")
    p.add_argument(
        "--control", default=arm_label(True, True), help="the arm the others are compared with"
    )
    p.add_argument("--note", default="", help="recorded in the JSON")
    p.add_argument("--bootstrap", type=int, default=2000)
    args = p.parse_args(argv)
    answers = load_answers(args.folder)
    summary = {**summarize(answers, args.control, args.bootstrap), "note": args.note}
    summary["markdown"] = markdown(summary)
    print(summary["markdown"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    st.write_per_instance(answers, args.json.with_name(args.json.stem + "_instances.csv.gz"))
    return summary


cli = command(main)  # one-line errors, exit 2

if __name__ == "__main__":
    cli()
