"""Reading the position ablation: load runs (the W&B API, or the CSV log of local run folders), tidy frames, plots.

Every loader returns one tidy frame with the columns of :data:`COLUMNS`: one row per
(run, step, metric) with the run's W&B group and its variant — the ablation toggles
``reset_position_ids`` and ``document_mask`` and a readable label. Plots are matplotlib figures
(Agg backend), saved as PNG, so they read the same with or without a notebook.

    python -m studies.analysis LOCAL_FOLDER --out docs/results/position_ablation/ablation.png
    python -m studies.analysis --wandb ENTITY/PROJECT --group position_ablation --out ablation.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from longctx.cli import command
from longctx.data.arms import ARM_ORDER, arm_label
from longctx.errors import LongctxError
from longctx.eval.files import EVAL_DIR, PASSKEY_ACCURACY_CSV
from studies.ablation import format_summary, per_instance, summarize
from studies.statistics import check_replicates, write_per_instance
from studies.sweep_files import (
    CSV_LOG,
    find_runs,
    metrics_log,
    read_table,
    require_runs,
    run_name,
    run_settings,
)

COLUMNS = [
    "run", "group", "variant", "reset_position_ids", "document_mask", "step", "metric", "value",
]  # fmt: skip
POSITION_METRIC = re.compile(r"^(?P<split>\w+)/loss_by_(?P<kind>abs|doc)_pos/(?P<start>\d+)$")
KIND_NAMES = {"abs": "absolute position in row", "doc": "position inside document"}
VARIANT_COLORS = dict(zip(ARM_ORDER, ["C0", "C1", "C2", "C3"], strict=True))


# ----------------------------------------------------------------------------- tidy frames
def tidy_frame(
    rows: Iterable[tuple[int, str, float]], run: str, group: str | None, toggles: dict
) -> pd.DataFrame:
    """(step, metric, value) rows of one run -> the tidy frame (non-finite values dropped)."""
    reset, mask = _toggle(toggles, "reset_position_ids"), _toggle(toggles, "document_mask")
    frame = pd.DataFrame(list(rows), columns=["step", "metric", "value"])
    frame = frame[np.isfinite(frame["value"].astype(float))]
    frame = frame.assign(
        run=run,
        group=group,
        variant=arm_label(reset, mask),
        reset_position_ids=reset,
        document_mask=mask,
        step=frame["step"].astype(int),
        value=frame["value"].astype(float),
    )
    return frame[COLUMNS].reset_index(drop=True)


def _toggle(toggles: dict, name: str) -> bool:
    value = toggles.get(name)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise LongctxError(
            f"run config has {name}={value!r}; expected a bool (data.{name} of the ablation)"
        )
    return value


def concat(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    return pd.concat(frames, ignore_index=True)


# ------------------------------------------------------------------------ local run folders
def load_local(root: str | Path) -> pd.DataFrame:
    """All runs under root, from the CSV log every run writes (csv/metrics.csv; W&B offline
    runs upload with ``wandb sync`` and read back with :func:`load_wandb`)."""
    root = Path(root)
    return concat([load_run_dir(r, root) for r in require_runs(root)])


def load_run_dir(run_dir: Path, root: Path | None = None) -> pd.DataFrame:
    settings = run_settings(run_dir)
    csv_file = metrics_log(run_dir)
    if csv_file is None:
        raise FileNotFoundError(
            f"run {run_dir} has no metrics: expected {run_dir / CSV_LOG} (logger=csv, or the default "
            "logger=wandb, which writes it too)"
        )
    name = run_name(run_dir, root or run_dir)
    return tidy_frame(csv_rows(csv_file), name, settings["run"].get("group"), settings["data"])


def csv_rows(path: Path) -> list[tuple[int, str, float]]:
    """Lightning CSVLogger metrics.csv -> (step, metric, value) rows. A resumed run appends
    to the file, so steps redone after a crash appear twice: the later row wins."""
    wide = read_table(path, numeric=["step"], sparse=True)  # every column a number
    long = wide.drop(columns=[c for c in ("epoch",) if c in wide]).melt(
        id_vars="step", var_name="metric", value_name="value"
    )
    long = long.dropna(subset=["value"]).drop_duplicates(["step", "metric"], keep="last")
    return list(long[["step", "metric", "value"]].itertuples(index=False, name=None))


# ------------------------------------------------------------------------ W&B public API
def load_wandb(path: str, group: str, api=None) -> pd.DataFrame:
    """Runs of a W&B project ("entity/project") in one group, via the public API (network)."""
    if api is None:
        import wandb

        api = wandb.Api()
    runs = list(api.runs(path, filters={"group": group}))
    if not runs:
        raise LookupError(f"W&B project {path} has no runs in group {group!r}")
    return concat([frame_from_api_run(r) for r in runs])


def frame_from_api_run(run) -> pd.DataFrame:
    """A tidy frame from a wandb.apis.public.Run (id, name, group, config, scan_history())."""
    rows = []
    for entry in run.scan_history():
        rows.extend(_history_rows_from_dict(entry))
    toggles = dict(run.config.get("data") or {})
    name = run.name or run.id
    return tidy_frame(rows, name, run.group, toggles)


def _history_rows_from_dict(entry: dict) -> list[tuple[int, str, float]]:
    step = entry.get("trainer/global_step", entry.get("_step"))
    if step is None or (isinstance(step, float) and math.isnan(step)):
        return []
    return [
        (int(step), k, float(v))
        for k, v in entry.items()
        if not k.startswith("_") and k != "trainer/global_step"
        and isinstance(v, int | float) and not isinstance(v, bool) and v is not None
    ]  # fmt: skip


# ----------------------------------------------------------------------- derived frames
def position_frame(frame: pd.DataFrame, step: int | None = None) -> pd.DataFrame:
    """Per-position loss rows (run, variant, step, split, kind, bucket_start, loss) at each run's
    last validation step (or the given step)."""
    parts = frame["metric"].str.extract(POSITION_METRIC)
    rows = frame.join(parts).dropna(subset=["kind"])
    if rows.empty:
        return pd.DataFrame(
            columns=["run", "variant", "step", "split", "kind", "bucket_start", "loss"]
        )
    if step is None:
        last = rows.groupby("run")["step"].transform("max")
        rows = rows[rows["step"] == last]
    else:
        rows = rows[rows["step"] == step]
    rows = rows.assign(bucket_start=rows["start"].astype(int), loss=rows["value"])
    columns = ["run", "variant", "reset_position_ids", "document_mask", "step", "split", "kind"]
    return rows[columns + ["bucket_start", "loss"]].sort_values(["run", "kind", "bucket_start"])


def load_probes(root: str | Path) -> pd.DataFrame:
    """Passkey accuracy tables (eval/passkey_accuracy.csv) of every run under root."""
    frames = []
    for run_dir in find_runs(root):
        path = run_dir / EVAL_DIR / PASSKEY_ACCURACY_CSV
        if path.is_file():
            data = run_settings(run_dir)["data"]
            reset, mask = _toggle(data, "reset_position_ids"), _toggle(data, "document_mask")
            frames.append(
                read_table(path, numeric=["length", "depth", "accuracy"]).assign(
                    run=str(run_dir.relative_to(root)),
                    variant=arm_label(reset, mask),
                    reset_position_ids=reset,
                    document_mask=mask,
                )
            )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def ema(values: Sequence[float], smoothing: float) -> np.ndarray:
    """Debiased exponential moving average (W&B / TensorBoard style); smoothing in [0, 1)."""
    if not 0.0 <= smoothing < 1.0:
        raise LongctxError(f"smoothing={smoothing}; expected 0 <= smoothing < 1")
    # adjust=True is the debiasing: each value over the sum of the weights seen so far
    series = pd.Series(values, dtype=float)
    return series.ewm(alpha=1 - smoothing, adjust=True).mean().to_numpy()


# --------------------------------------------------------------------------------- plots
def _variants(frame: pd.DataFrame) -> list[tuple[bool, bool]]:
    present = set(zip(frame["reset_position_ids"], frame["document_mask"], strict=True))
    return [v for v in ARM_ORDER if v in present]


def plot_training_curves(
    frame: pd.DataFrame, metric: str = "train/loss", smoothing: float = 0.9, ax=None
):
    """The metric per variant: EMA-smoothed line over the raw values in a light colour."""
    fig, ax = _axes(ax)
    data = frame[frame["metric"] == metric]
    if data.empty:
        raise LongctxError(
            f"no rows for metric {metric!r}; metrics: {sorted(frame.metric.unique())}"
        )
    for reset, mask in _variants(data):
        sub = data[(data.reset_position_ids == reset) & (data.document_mask == mask)]
        for _, run in sub.groupby("run"):
            run = run.sort_values("step")
            color = VARIANT_COLORS[(reset, mask)]
            ax.plot(run["step"], run["value"], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(run["step"], ema(run["value"].to_numpy(), smoothing), color=color,
                    label=arm_label(reset, mask))  # fmt: skip
    ax.set(xlabel="step", ylabel=metric, title=f"{metric} (EMA {smoothing})")
    ax.legend(fontsize="small")
    return fig


def plot_position_loss(frame: pd.DataFrame, kind: str = "doc", step: int | None = None, ax=None):
    """Validation loss by log2 position bucket per variant (kind "abs" or "doc")."""
    if kind not in KIND_NAMES:
        raise LongctxError(f"kind={kind!r}; expected one of {sorted(KIND_NAMES)}")
    fig, ax = _axes(ax)
    data = position_frame(frame, step)
    data = data[data["kind"] == kind]
    if data.empty:
        runs = ", ".join(sorted(map(str, frame["run"].unique()))) or "none"
        raise LongctxError(
            f"no per-position loss metrics (val/loss_by_{kind}_pos/*) in the runs ({runs}): "
            "they never validated; train with validation (trainer.val_check_interval)"
        )
    for reset, mask in _variants(data):
        sub = data[(data.reset_position_ids == reset) & (data.document_mask == mask)]
        for _, run in sub.groupby("run"):
            run = run.sort_values("bucket_start")
            x = run["bucket_start"].clip(lower=0.5)  # bucket 0 drawn at 0.5 on the log axis
            ax.plot(x, run["loss"], marker="o", markersize=3,
                    color=VARIANT_COLORS[(reset, mask)], label=arm_label(reset, mask))  # fmt: skip
    ax.set_xscale("log", base=2)
    starts = sorted(data["bucket_start"].unique())
    ax.set_xticks([max(s, 0.5) for s in starts], [str(s) for s in starts], fontsize="small")
    ax.minorticks_off()
    ax.set(xlabel=f"{KIND_NAMES[kind]} (bucket start)", ylabel="val loss",
           title=f"val loss by {KIND_NAMES[kind]}")  # fmt: skip
    ax.legend(fontsize="small")
    return fig


def plot_held_out_bands(positions: pd.DataFrame, ax=None):
    """Held-out loss by in-document position bucket per arm, with its bootstrap CI as a band
    (``positions``: the "positions" records of studies.ablation.summarize)."""
    if positions.empty:
        raise LongctxError("no held-out position records to plot")
    fig, ax = _axes(ax)
    for i, (arm, part) in enumerate(positions.groupby("arm", sort=False)):
        part = part.sort_values("bucket_start")
        x = part["bucket_start"].clip(lower=0.5)
        ax.plot(x, part["loss"], marker="o", markersize=3, color=f"C{i}", label=arm)
        ax.fill_between(x, part["low"], part["high"], color=f"C{i}", alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="position inside document (bucket start)", ylabel="held-out loss",
           title="held-out documents, each alone (95% CI)")  # fmt: skip
    ax.legend(fontsize="small")
    return fig


def plot_retrieval_heatmaps(probes: pd.DataFrame, value: str = "accuracy"):
    """One needle heat map (depth x context length) per variant."""
    if probes.empty:
        raise LongctxError("no passkey probe results (eval/passkey_accuracy.csv) to plot")
    variants = _variants(probes)
    fig, axes = plt.subplots(
        1, len(variants), figsize=(4 * len(variants), 3.4), squeeze=False, sharey=True
    )
    for ax, (reset, mask) in zip(axes[0], variants, strict=True):
        sub = probes[(probes.reset_position_ids == reset) & (probes.document_mask == mask)]
        grid = sub.pivot_table(index="depth", columns="length", values=value, aggfunc="mean")
        image = ax.imshow(grid.to_numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto",
                          origin="lower")  # fmt: skip
        ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns])
        ax.set_yticks(range(len(grid.index)), [f"{d:.2f}" for d in grid.index])
        ax.set(xlabel="context length", title=arm_label(reset, mask))
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label=f"passkey {value}")
    return fig


def ablation_figure(frame: pd.DataFrame, title: str | None = None, smoothing: float = 0.9):
    """Three panels: training loss, val loss by position in document, by position in row."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    plot_training_curves(frame, smoothing=smoothing, ax=axes[0])
    plot_position_loss(frame, "doc", ax=axes[1])
    plot_position_loss(frame, "abs", ax=axes[2])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path, dpi: int = 120, close: bool = True) -> Path:
    """Save as PNG (or the suffix's format); close=False keeps it open for a notebook to show."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    if close:
        plt.close(fig)
    return path


def _axes(ax):
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
        return fig, ax
    return ax.figure, ax


# ----------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m studies.analysis", description=__doc__.split("\n")[0]
    )
    p.add_argument("folder", nargs="?", type=Path, help="local folder holding run folders")
    p.add_argument("--wandb", default=None, help="W&B ENTITY/PROJECT (instead of a folder)")
    p.add_argument("--group", default="position_ablation", help="W&B group (with --wandb)")
    p.add_argument("--out", type=Path, default=Path("docs/results/position_ablation/ablation.png"))
    p.add_argument("--smoothing", type=float, default=0.9)
    p.add_argument("--title", default=None)
    p.add_argument(
        "--summary",
        type=Path,
        default=None,
        help="where the arm/pair summary JSON goes (default: --out with .json)",
    )
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap replicates")
    p.add_argument(
        "--allow-mixed",
        action="store_true",
        help="compare runs of different experiments or sequence lengths anyway",
    )
    return p.parse_args(argv)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    matplotlib.use("Agg")  # files only, no display
    if (args.folder is None) == (args.wandb is None):
        raise LongctxError(
            f"folder={args.folder}, --wandb={args.wandb}; give either a local FOLDER or "
            "--wandb ENTITY/PROJECT (not both)"
        )
    check_replicates(args.bootstrap)  # before the figure is written
    frame = load_wandb(args.wandb, args.group) if args.wandb else load_local(args.folder)
    try:
        figure = ablation_figure(frame, args.title, args.smoothing)
    except LongctxError as err:
        raise LongctxError(f"{args.folder or args.wandb}: {err}") from err
    written = [save_figure(figure, args.out)]
    if args.folder:
        written += write_summary(args)
    probes = load_probes(args.folder) if args.folder else pd.DataFrame()
    if not probes.empty:
        heat = args.out.with_name(args.out.stem + "_passkey" + args.out.suffix)
        written.append(save_figure(plot_retrieval_heatmaps(probes), heat))
    for path in written:
        print(f"wrote {path}")
    return written


def write_summary(args: argparse.Namespace) -> list[Path]:
    """Print the arm and pair tables; write the summary JSON and the held-out band figure."""
    summary = summarize(args.folder, args.bootstrap, allow_mixed=args.allow_mixed)
    print(format_summary(summary))
    path = args.summary or args.out.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    # beside the JSON, what its numbers are recomputed from: per run, seed and document
    instances = path.with_name(path.stem + "_instances.csv.gz")
    write_per_instance(per_instance(args.folder), instances)
    bands = plot_held_out_bands(pd.DataFrame(summary["positions"]))
    return [path, instances,
            save_figure(bands, args.out.with_name(args.out.stem + "_held_out.png"))]  # fmt: skip


cli = command(main)  # the console script and python -m: one-line errors, exit 2

if __name__ == "__main__":
    cli()
