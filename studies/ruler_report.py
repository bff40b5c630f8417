"""python -m studies.ruler_report ROOT: the suite per arm of a sweep, paired, with heat maps.

ROOT holds run folders (any depth) that the suite scored: ``eval/ruler/ruler_results.csv`` (the
final ``python -m longctx.eval ... --suite ruler``) or else ``eval/ruler_results.csv`` (the in-loop
callback: its last step).
Every run was scored on the same instances (one instance seed), so arms are compared paired:

- per arm and length: the suite score (mean over the tasks of each task's mean per-instance
  ``score``: RULER's metric when the suite generated, the teacher-forced match when not), its 95%
  bootstrap interval over instances and training seeds, RULER's effective length (over RULER's
  tasks) and, beside it, the relative one anchored at the runs' training length (both
  longctx.eval.ruler.effective_length's rules, printed with them), the relative one also per seed;
- per arm against the control arm and length, on the suite score and on every task's: the
  difference with its 95% interval from the hierarchical bootstrap of
  studies.statistics (training seeds, then instances within each; paired by seed
  where the arms share their seeds) and a verdict; beside it the seed-level t interval over the
  per-seed differences and their signs (``seed_level``: with few seeds, the wider of the two);
- beside the JSON: the per-instance rows (``_instances.csv.gz``) and per-seed suite scores
  (``_seeds.csv``);
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
from longctx.errors import LongctxError
from longctx.eval.files import EVAL_DIR, RULER_RESULTS_CSV, RULER_SUMMARY_JSON
from longctx.eval.ruler.effective_length import relative_effective_length, ruler_effective_length
from longctx.eval.ruler.generate import chance
from longctx.synthetic.tasks import RULER_TASKS
from studies import statistics as st
from studies.ablation import verdict

# the final evaluation (python -m longctx.eval ... --suite ruler), else the in-loop callback's
RESULTS = (Path(EVAL_DIR) / "ruler" / RULER_RESULTS_CSV, Path(EVAL_DIR) / RULER_RESULTS_CSV)
ARM_BY = ("position", "rope_arm", "group")
INSTANCE = ["task", "length", "depth", "sample"]


def arm_of(folder: Path, settings: dict, arm_by: str) -> str:
    """``settings``: the run's recorded {"model", "data", "run"}
    (studies.sweep_files)."""
    if arm_by == "position":
        from longctx.data.arms import arm_label

        data = settings["data"]
        return arm_label(_bool(data["reset_position_ids"]), _bool(data["document_mask"]))
    if arm_by == "rope_arm":
        from studies.extension_report import arm_name

        return arm_name(folder)
    return str(settings["run"].get("group"))


def _bool(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() == "true"


def load_results(root: str | Path, arm_by: str) -> pd.DataFrame:
    """One row per (run, instance): arm, seed, run, train_len, task, length, depth, sample,
    score (results written before generation scoring: their teacher-forced ``correct``)."""
    from studies.sweep_files import find_runs, read_table, run_settings

    if arm_by not in ARM_BY:
        raise LongctxError(f"--arm-by {arm_by!r}; expected one of {ARM_BY}")
    frames = []
    for folder in find_runs(root):
        path = next((folder / r for r in RESULTS if (folder / r).is_file()), None)
        if path is None:
            continue  # a run the suite did not score (stage 1 of a recipe, say)
        rows = read_table(path, numeric=["length", "depth", "sample", "score"], text=["task"])
        if "step" in rows:  # the callback's: every validation, the instance seed per row
            rows = rows[rows["step"] == rows["step"].max()]
        else:  # the CLI's: the instance seed is in its ruler.json
            rows = rows.assign(seed=instance_seed(path.parent / RULER_SUMMARY_JSON))
        settings = run_settings(folder)
        frames.append(rows.assign(arm=arm_of(folder, settings, arm_by),
                                  seed_train=settings["run"].get("seed"),
                                  train_len=settings["data"].get("seq_len"),
                                  run=str(folder.relative_to(root))))  # fmt: skip
    if not frames:
        raise FileNotFoundError(
            f"no run folder under {root} holds {' or '.join(map(str, RESULTS))}"
        )
    return pd.concat(frames, ignore_index=True)


def instance_seed(path: Path) -> int:
    """The instance seed the CLI's ruler.json records (settings.instance_seed)."""
    from studies.sweep_files import read_json_file

    summary = read_json_file(path, "the suite's ruler.json")
    settings = summary.get("settings") if isinstance(summary, dict) else None
    seed = settings.get("instance_seed") if isinstance(settings, dict) else None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise LongctxError(
            f"{path} has no integer settings.instance_seed ({seed!r}); expected the ruler.json "
            "python -m longctx.eval --suite ruler writes"
        )
    return seed


def arm_sample(frame: pd.DataFrame) -> st.ArmSample:
    """One arm at one length: scores [training seeds, instances] over task weights, so the
    statistic is the mean over tasks of each task's mean score (the suite score) and instances
    line up across arms (sorted by task, length, depth, sample)."""
    return st.arm_sample(frame.assign(weighted=frame["score"] * task_weights(frame),
                                      weight=task_weights(frame)),
                         "weighted", "weight", INSTANCE, seed="seed_train")  # fmt: skip


def task_weights(frame: pd.DataFrame) -> np.ndarray:
    """Per row: 1 / (rows of its task at its seed), so a weighted mean over instances is the
    mean over tasks of each task's mean, as the suite score is."""
    return 1.0 / frame.groupby(["seed_train", "task"])["task"].transform("size").to_numpy()


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
            raise LongctxError(f"control arm {first!r} is not in the sweep's arms {arms}")
        arms = [first] + [a for a in arms if a != first]
    return arms


def _instance_seed(frame: pd.DataFrame):
    seeds = sorted(int(s) for s in frame["seed"].unique()) if "seed" in frame else []
    return seeds[0] if len(seeds) == 1 else seeds


def _arm(part: pd.DataFrame, arm: str, floor: float, n_boot: int, rng) -> dict:
    rows = []
    seed_scores: dict[int, dict[int, float]] = {}
    for length, at in part.groupby("length"):
        sample = arm_sample(at)
        low, high = st.interval(st.bootstrap(sample, n_boot, rng))
        rows.append({"length": int(length), "score": sample.estimate, "ci": [low, high]})
        for seed, score in sample.per_seed().items():
            seed_scores.setdefault(int(seed), {})[int(length)] = score
    anchor = _anchor(part)
    found = _relative({r["length"]: r["score"] for r in rows}, anchor, floor)
    per_seed = {}
    for seed, own in part.groupby("seed_train"):
        scores = own.groupby(["length", "task"])["score"].mean().groupby("length").mean()
        per_seed[int(seed)] = _relative(scores.to_dict(), anchor, floor).get("length")
    by_task = part.groupby(["task", "length"])["score"].mean().reset_index()
    per_task = {
        task: _relative(dict(zip(rows_["length"], rows_["score"], strict=True)), anchor,
                        chance(task)).get("length")
        for task, rows_ in by_task.groupby("task")
    }  # fmt: skip
    ruler = part[part["task"].isin(RULER_TASKS)]
    ruler_scores = ruler.groupby(["length", "task"])["score"].mean().groupby("length").mean()
    return {
        "arm": arm,
        "seeds": sorted(int(s) for s in part["seed_train"].unique()),
        "runs": sorted(part["run"].unique()),
        "suite": rows,
        "ruler_effective_length": (
            ruler_effective_length({int(n): float(v) for n, v in ruler_scores.items()})
            if len(ruler)
            else None
        ),
        "ruler_tasks": sorted(ruler["task"].unique()),
        "effective_length": found.get("length"),
        "effective_length_rule": found.get("rule"),
        "seed_effective_lengths": per_seed,
        "seed_scores": seed_scores,  # per training seed and length: the suite score
        "task_effective_lengths": per_task,
        "tasks": by_task.to_dict("records"),
    }


def _anchor(part: pd.DataFrame) -> int | None:
    """The runs' training length (the relative rule's anchor); None when they differ."""
    lengths = part["train_len"].dropna().unique() if "train_len" in part else []
    return int(lengths[0]) if len(lengths) == 1 else None


def _relative(scores: dict, anchor: int | None, floor: float) -> dict:
    """The relative rule's result as a dict; empty when the anchor was not evaluated."""
    scores = {int(n): float(v) for n, v in scores.items()}
    if anchor not in scores:
        return {"rule": f"relative: not computed (training length {anchor} not evaluated)"}
    return relative_effective_length(scores, anchor, floor).to_dict()


def _pair(frame: pd.DataFrame, arm: str, control: str, n_boot: int, rng) -> dict:
    """arm - control per length, on the suite score and on each task's score: paired by
    training seed (studies.statistics) when the two arms share their seeds."""
    rows, tasks = [], []
    for length, at in frame.groupby("length"):
        a, b = at[at["arm"] == arm], at[at["arm"] == control]
        rows.append({"length": int(length), **_difference(a, b, n_boot, rng)})
        for task, own in a.groupby("task"):
            theirs = b[b["task"] == task]
            tasks.append({"task": task, "length": int(length),
                          **_difference(own, theirs, n_boot, rng)})  # fmt: skip
    return {"a": arm, "b": control, "by_length": rows, "by_task": tasks}


def _difference(a: pd.DataFrame, b: pd.DataFrame, n_boot: int, rng) -> dict:
    sample_a, sample_b = arm_sample(a), arm_sample(b)
    row = st.difference(sample_a, sample_b, n_boot, rng, st.shares_seeds(sample_a, sample_b))
    return {**row, "verdict": verdict(*row["ci"])}


def markdown(summary: dict) -> str:
    lengths = summary["lengths"]
    head = "| arm | " + " | ".join(map(str, lengths)) + " | RULER's effective length | relative |"
    lines = [head, "|---|" + "---|" * (len(lengths) + 2)]
    for arm in summary["arms"]:
        cells = {r["length"]: r for r in arm["suite"]}
        text = [f"{cells[n]['score']:.2f} [{cells[n]['ci'][0]:.2f}, {cells[n]['ci'][1]:.2f}]"
                for n in lengths]  # fmt: skip
        lengths_ = f" | {arm['ruler_effective_length']} | {arm['effective_length']} |"
        lines.append(f"| {arm['arm']} | " + " | ".join(text) + lengths_)
    for pair in summary["pairs"]:
        text = [
            f"{r['delta']:+.2f} [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]; seed-level "
            f"{st.seed_level_text(r, '+.2f')}"
            for r in pair["by_length"]
        ]
        paired = "" if all(r["paired"] for r in pair["by_length"]) else " (unpaired)"
        lines.append(f"| {pair['a']} - {pair['b']}{paired} | " + " | ".join(text) + " | | |")
    return "\n".join(lines)


def write_beside(path: Path, frame: pd.DataFrame, summary: dict) -> list[Path]:
    """Beside the summary JSON: every run's per-instance rows (``_instances.csv.gz``) and the
    suite score per arm, training seed and length (``_seeds.csv``), what its numbers are
    recomputed from."""
    instances = path.with_name(path.stem + "_instances.csv.gz")
    st.write_per_instance(frame, instances)
    seeds = path.with_name(path.stem + "_seeds.csv")
    rows = [{"arm": arm["arm"], "seed": seed, "length": length, "score": score}
            for arm in summary["arms"] for seed, by_length in arm["seed_scores"].items()
            for length, score in by_length.items()]  # fmt: skip
    pd.DataFrame(rows).to_csv(seeds, index=False)
    return [instances, seeds]


def heatmaps(frame: pd.DataFrame, arms: Sequence[str], title: str):
    """One length x depth heat map per arm: mean score over tasks and seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(arms), figsize=(3.6 * len(arms), 3.4), squeeze=False,
                             sharey=True)  # fmt: skip
    image = None
    for ax, arm in zip(axes[0], arms, strict=True):
        part = frame[frame["arm"] == arm]
        per_task = part.groupby(["depth", "length", "task"])["score"].mean()
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
    fig.colorbar(image, ax=axes[0].tolist(), label="score (mean over tasks)")
    return fig


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m studies.ruler_report",
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
    write_beside(args.json, frame, summary)
    print(summary["markdown"])
    for arm in summary["arms"]:
        print(f"{arm['arm']}: RULER's effective length {arm['ruler_effective_length']}; relative "
              f"{arm['effective_length']} (seeds {arm['seed_effective_lengths']}): "
              f"{arm['effective_length_rule']}")  # fmt: skip
    print(f"wrote {args.json} and {figure}")
    return summary


cli = command(main)  # python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
