"""python -m longctx.experiments.ruler_report ROOT: the suite per arm of a sweep, paired, with heat maps.

ROOT holds run folders (any depth) that the suite scored: ``eval/ruler/ruler_results.csv`` (the
final ``python -m longctx.eval ... --suite ruler``) or else ``eval/ruler_results.csv`` (the in-loop
callback: its last step).
Every run was scored on the same instances (one instance seed), so arms are compared paired:

- per arm and length: the suite score (mean accuracy over the tasks), its 95% bootstrap interval
  over instances and training seeds, and the arm's effective length (longctx.eval.ruler.scoring's
  rule, printed with it), also per seed;
- per arm against the control arm and length: the paired difference with its 95% bootstrap
  interval (instances and seeds resampled together, longctx.experiments.ablation's bootstrap) and a verdict;
- a heat map of length x depth per arm (mean over tasks and seeds).

Arms (``--arm-by``): ``position`` (data.reset_position_ids x data.document_mask, the position
ablation: the masked pair is its rounding control), ``rope_arm`` (the context-extension arm in
the run folder's name) or ``group`` (the run's W&B group: the positive control's two arms).
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
from longctx.eval.ruler.generate import chance
from longctx.eval.ruler.scoring import effective_length
from longctx.experiments.ablation import bootstrap_difference, bootstrap_loss, interval, verdict

# the final evaluation (python -m longctx.eval ... --suite ruler), else the in-loop callback's
RESULTS = (Path("eval") / "ruler" / "ruler_results.csv", Path("eval") / "ruler_results.csv")
ARM_BY = ("position", "rope_arm", "group")
INSTANCE = ["task", "length", "depth", "sample"]


def arm_of(folder: Path, settings: dict, arm_by: str) -> str:
    """``settings``: the run's recorded {"model", "data", "run"} (longctx.experiments.runs)."""
    if arm_by == "position":
        from longctx.data.arms import arm_label

        data = settings["data"]
        return arm_label(_bool(data["reset_position_ids"]), _bool(data["document_mask"]))
    if arm_by == "rope_arm":
        from longctx.experiments.extension_report import arm_name

        return arm_name(folder)
    return str(settings["run"].get("group"))


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() == "true"


def load_results(root: str | Path, arm_by: str) -> pd.DataFrame:
    """One row per (run, instance): arm, seed, run, task, length, depth, sample, correct."""
    from longctx.experiments.runs import find_runs, run_settings

    if arm_by not in ARM_BY:
        raise ValueError(f"--arm-by {arm_by!r}; expected one of {ARM_BY}")
    frames = []
    for folder in find_runs(root):
        path = next((folder / r for r in RESULTS if (folder / r).is_file()), None)
        if path is None:
            continue  # a run the suite did not score (stage 1 of a recipe, say)
        rows = pd.read_csv(path)
        if "step" in rows:  # the callback's: every validation, the instance seed per row
            rows = rows[rows["step"] == rows["step"].max()]
        else:  # the CLI's: the instance seed is in its ruler.json
            settings = json.loads((path.parent / "ruler.json").read_text())["settings"]
            rows = rows.assign(seed=settings["instance_seed"])
        settings = run_settings(folder)
        frames.append(rows.assign(arm=arm_of(folder, settings, arm_by),
                                  seed_train=settings["run"].get("seed"),
                                  run=str(folder.relative_to(root))))  # fmt: skip
    if not frames:
        raise FileNotFoundError(
            f"no run folder under {root} holds {' or '.join(map(str, RESULTS))}"
        )
    return pd.concat(frames, ignore_index=True)


def correct_matrix(frame: pd.DataFrame) -> np.ndarray:
    """[training seeds, instances] of 0/1, instances in a fixed order (paired across arms)."""
    table = frame.pivot_table(index="seed_train", columns=INSTANCE, values="correct",
                              aggfunc="mean")  # fmt: skip
    return table.sort_index(axis=1).to_numpy(dtype=float)


def task_weights(frame: pd.DataFrame) -> np.ndarray:
    """Per instance (the matrix's column order): 1 / instances of its task, so a resampled sum
    over instances is the mean over tasks of each task's accuracy, as the suite score is."""
    keys = frame.drop_duplicates(INSTANCE).sort_values(INSTANCE)
    per_task = keys.groupby("task")["task"].transform("size")
    tasks = keys["task"].nunique()
    return (1.0 / (per_task * tasks)).to_numpy() * len(keys)


def summarize(root: str | Path, arm_by: str, control: str | None = None, n_boot: int = 2000,
              seed: int = 0) -> dict:  # fmt: skip
    frame = load_results(root, arm_by)
    arms = ordered(frame["arm"].unique(), arm_by, control)
    control = arms[0]
    tasks = sorted(frame["task"].unique())
    floor = float(np.mean([chance(t) for t in tasks]))
    rng = np.random.default_rng(seed)
    summary = {
        "root": str(root),
        "arm_by": arm_by,
        "control": control,
        "instance_seed": _instance_seed(frame),
        "tasks": tasks,
        "lengths": sorted(int(n) for n in frame["length"].unique()),
        "bootstrap": {"replicates": n_boot, "confidence": 0.95, "seed": seed},
        "arms": [_arm(frame[frame["arm"] == a], a, floor, n_boot, rng) for a in arms],
        "pairs": [_pair(frame, a, control, n_boot, rng) for a in arms[1:]],
    }
    summary["markdown"] = markdown(summary)
    return summary


def ordered(arms, arm_by: str, control: str | None) -> list[str]:
    arms = sorted(arms)
    if arm_by == "position":
        from longctx.data.arms import ARM_ORDER, arm_label

        rank = [arm_label(*a) for a in ARM_ORDER]
        arms = sorted(arms, key=lambda a: rank.index(a) if a in rank else 99)
    first = control or ("unchanged" if arm_by == "rope_arm" else None)
    if first is not None:
        if first not in arms:
            raise ValueError(f"control arm {first!r} is not in the sweep's arms {arms}")
        arms = [first] + [a for a in arms if a != first]
    return arms


def _instance_seed(frame: pd.DataFrame):
    seeds = sorted(int(s) for s in frame["seed"].unique()) if "seed" in frame else []
    return seeds[0] if len(seeds) == 1 else seeds


def _arm(part: pd.DataFrame, arm: str, floor: float, n_boot: int, rng) -> dict:
    rows = []
    for length, at in part.groupby("length"):
        sums, weights = correct_matrix(at), task_weights(at)
        low, high = interval(bootstrap_loss(sums * weights, np.ones_like(weights), n_boot, rng))
        score = float((sums.mean(0) * weights).mean())
        rows.append({"length": int(length), "score": score, "ci": [low, high]})
    found = effective_length({r["length"]: r["score"] for r in rows}, floor)
    per_seed = {}
    for seed, own in part.groupby("seed_train"):
        scores = own.groupby(["length", "task"])["correct"].mean().groupby("length").mean()
        per_seed[int(seed)] = effective_length(scores.to_dict(), floor).length
    by_task = part.groupby(["task", "length"])["correct"].mean().reset_index()
    per_task = {
        task: effective_length(dict(zip(rows_["length"], rows_["correct"], strict=True)),
                               chance(task)).length
        for task, rows_ in by_task.groupby("task")
    }  # fmt: skip
    return {
        "arm": arm,
        "seeds": sorted(int(s) for s in part["seed_train"].unique()),
        "runs": sorted(part["run"].unique()),
        "suite": rows,
        "effective_length": found.length,
        "effective_length_rule": found.rule,
        "seed_effective_lengths": per_seed,
        "task_effective_lengths": per_task,
        "tasks": by_task.rename(columns={"correct": "accuracy"}).to_dict("records"),
    }


def _pair(frame: pd.DataFrame, arm: str, control: str, n_boot: int, rng) -> dict:
    rows = []
    for length, at in frame.groupby("length"):
        a, b = at[at["arm"] == arm], at[at["arm"] == control]
        sums_a, sums_b = correct_matrix(a), correct_matrix(b)
        if sums_a.shape != sums_b.shape:
            raise ValueError(
                f"arms {arm!r} and {control!r} were scored on different instances or seeds at "
                f"length {length} ({sums_a.shape} vs {sums_b.shape}); score both alike"
            )
        weights = task_weights(a)
        delta = float(((sums_a.mean(0) - sums_b.mean(0)) * weights).mean())
        replicates = bootstrap_difference(sums_a * weights, sums_b * weights,
                                          np.ones_like(weights), n_boot, rng)  # fmt: skip
        low, high = interval(replicates)
        rows.append({"length": int(length), "delta": delta, "ci": [low, high],
                     "verdict": verdict(low, high)})  # fmt: skip
    return {"a": arm, "b": control, "by_length": rows}


def markdown(summary: dict) -> str:
    lengths = summary["lengths"]
    head = "| arm | " + " | ".join(map(str, lengths)) + " | effective length |"
    lines = [head, "|---|" + "---|" * (len(lengths) + 1)]
    for arm in summary["arms"]:
        cells = {r["length"]: r for r in arm["suite"]}
        text = [f"{cells[n]['score']:.2f} [{cells[n]['ci'][0]:.2f}, {cells[n]['ci'][1]:.2f}]"
                for n in lengths]  # fmt: skip
        lines.append(f"| {arm['arm']} | " + " | ".join(text) + f" | {arm['effective_length']} |")
    for pair in summary["pairs"]:
        text = [
            f"{r['delta']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]" for r in pair["by_length"]
        ]
        lines.append(f"| {pair['a']} - {pair['b']} | " + " | ".join(text) + " | |")
    return "\n".join(lines)


def heatmaps(frame: pd.DataFrame, arms: Sequence[str], title: str):
    """One length x depth heat map per arm: mean accuracy over tasks and seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(arms), figsize=(3.6 * len(arms), 3.4), squeeze=False,
                             sharey=True)  # fmt: skip
    image = None
    for ax, arm in zip(axes[0], arms, strict=True):
        part = frame[frame["arm"] == arm]
        per_task = part.groupby(["depth", "length", "task"])["correct"].mean()
        grid = per_task.groupby(["depth", "length"]).mean().unstack("length")
        image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto",
                          origin="lower")  # fmt: skip
        ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [f"{d:.2f}" for d in grid.index])
        ax.set(xlabel="context length", title=textwrap.fill(arm, 28))
    axes[0][0].set_ylabel("needle depth")
    lines = textwrap.fill(title, 110)
    fig.suptitle(lines, fontsize=8, y=0.99, va="top")
    # the arms' titles start below the suptitle's lines (before the colorbar takes its share)
    fig.subplots_adjust(top=0.8 - 0.04 * lines.count("\n"))
    fig.colorbar(image, ax=axes[0].tolist(), label="accuracy (mean over tasks)")
    return fig


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m longctx.experiments.ruler_report",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("root", type=Path, help="a folder holding the sweep's run folders")
    p.add_argument("--arm-by", choices=ARM_BY, required=True)
    p.add_argument("--control", default=None, help="the arm the others are compared with")
    p.add_argument("--json", type=Path, required=True, help="the summary JSON")
    p.add_argument("--figure", type=Path, default=None, help="heat maps (default: --json .png)")
    p.add_argument("--note", default="", help="recorded in the JSON and the figure's title")
    p.add_argument("--extra", default=None, help="a JSON object merged into the summary")
    p.add_argument("--bootstrap", type=int, default=2000)
    args = p.parse_args(argv)
    summary = summarize(args.root, args.arm_by, args.control, args.bootstrap)
    summary["note"] = args.note
    summary |= json.loads(args.extra) if args.extra else {}
    figure = args.figure or args.json.with_suffix(".png")
    frame = load_results(args.root, args.arm_by)
    fig = heatmaps(frame, [a["arm"] for a in summary["arms"]], args.note)
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120, bbox_inches="tight")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1) + "\n")
    print(summary["markdown"])
    for arm in summary["arms"]:
        print(f"{arm['arm']}: effective length {arm['effective_length']} "
              f"(seeds {arm['seed_effective_lengths']}): {arm['effective_length_rule']}")  # fmt: skip
    print(f"wrote {args.json} and {figure}")
    return summary


cli = command(main)  # python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
