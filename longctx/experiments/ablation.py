"""Signal or noise: each arm's held-out loss and every pair's difference, with bootstrap CIs.

The input is what :class:`longctx.eval.callbacks.HeldOutDocumentLoss` writes into each run folder:
loss sums per (held-out document, in-document position bucket), the same documents for every arm.
Resampling documents (and, when the sweep has several seeds, seeds) gives

- per arm: the token-weighted held-out loss with its 95% CI;
- per pair of arms: the paired difference on the same documents, its CI and a verdict;
- the training-noise floor: resampling documents says whether two *trained models* differ, not
  whether two *arms* do. Training amplifies rounding: the two masked arms compute the same function
  up to ~1e-6, agree bitwise for the first few dozen steps and then drift apart (a 300-step run ends
  ~0.01 nats apart). So the masked pair is the sweep's control: the largest gap its CI allows is
  the floor below which a difference between arms is indistinguishable from rounding noise.
  Verdicts: "within noise" (the CI covers 0), "within training noise" (the CI reaches below the
  floor), "differs" (beyond both);
- per arm with several seeds: the seed-to-seed spread of the run losses;
- per arm and position bucket: the loss with its CI (the bands of the per-position figure).

An arm is a run's (reset_position_ids, document_mask, packer); :mod:`longctx.experiments.arms` names it.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pandas as pd

from longctx.experiments.arms import ARM_ORDER, arm_label
from longctx.experiments.runs import require_runs, run_name, run_settings

HELD_OUT_FILE = Path("eval") / "held_out_documents.csv"
ARM_KEYS = ("reset_position_ids", "document_mask", "packer")
CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class RunInfo:
    name: str
    folder: Path
    arm: tuple  # (reset_position_ids, document_mask, packer)
    seed: int
    group: str | None
    seq_len: int


# ------------------------------------------------------------------------------ loading
def run_infos(root: str | Path) -> list[RunInfo]:
    """Every run folder under root, with the settings that define its arm."""
    infos = []
    for folder in require_runs(root):
        settings = run_settings(folder)
        data, run = settings["data"], settings["run"]
        arm = tuple(_plain(data.get(k)) for k in ARM_KEYS)
        name = run_name(folder, Path(root))
        seed = run.get("seed", data.get("seed"))
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"run {name} has seed={seed!r} in its config; expected an int")
        infos.append(RunInfo(name, folder, arm, seed, run.get("group"), data.get("seq_len")))
    return infos


def _plain(value):
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def check_comparable(runs: list[RunInfo], allow_mixed: bool = False) -> None:
    """Refuse runs of different experiments or row lengths unless the caller says so."""
    for field in ("group", "seq_len"):
        values = sorted({str(getattr(r, field)) for r in runs})
        if len(values) > 1 and not allow_mixed:
            detail = ", ".join(f"{r.name}: {getattr(r, field)}" for r in runs)
            raise ValueError(
                f"runs mix {field} values {values} ({detail}); compare one experiment at one "
                "length, or pass --allow-mixed to compare them anyway"
            )


def held_out_frame(runs: list[RunInfo]) -> pd.DataFrame:
    """Rows (run, arm, seed, doc, bucket_start, tokens, loss_sum) at each run's last validation."""
    frames = []
    for run in runs:
        path = run.folder / HELD_OUT_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"run {run.name} has no held-out document losses ({path}): it never validated, "
                "or ran without callbacks=ablation (experiment files of ablations set it)"
            )
        data = pd.read_csv(path)
        data = data[data["step"] == data["step"].max()]
        frames.append(data.assign(run=run.name, arm=[run.arm] * len(data), seed=run.seed))
    frame = pd.concat(frames, ignore_index=True)
    _check_same_documents(frame)
    return frame


def _check_same_documents(frame: pd.DataFrame) -> None:
    tokens = frame.groupby(["run", "doc"])["tokens"].sum().unstack("run")
    if tokens.isna().any().any() or not (tokens.nunique(axis=1) == 1).all():
        raise ValueError(
            "the runs were scored on different held-out documents (document sets or lengths "
            f"differ: runs {sorted(frame['run'].unique())}); they are not comparable pairwise"
        )


def arm_names(arms: list[tuple]) -> dict[tuple, str]:
    """Readable names; the packer is named only when the arms differ in it."""
    packers = {a[2] for a in arms}
    return {a: arm_label(a[0], a[1]) + (f", {a[2]}" if len(packers) > 1 else "") for a in arms}


def ordered_arms(arms) -> list[tuple]:
    rank = {arm: i for i, arm in enumerate(ARM_ORDER)}
    return sorted(set(arms), key=lambda a: (rank.get((a[0], a[1]), 99), str(a[2])))


# ---------------------------------------------------------------------------- bootstrap
def loss_matrix(frame: pd.DataFrame, arm: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(loss sums [seeds, docs], tokens [docs]) of one arm, documents in a fixed order."""
    rows = frame[frame["arm"].apply(lambda a: a == arm)]
    sums = rows.groupby(["seed", "doc"])["loss_sum"].sum().unstack("doc").sort_index(axis=1)
    tokens = rows.groupby("doc")["tokens"].sum().sort_index() / sums.shape[0]
    return sums.to_numpy(), tokens.to_numpy()


def bootstrap_loss(sums, tokens, n_boot: int, rng) -> np.ndarray:
    """Replicates of the token-weighted loss, resampling documents (and seeds when > 1)."""
    seeds_avg = _resample_seeds(sums, n_boot, rng)  # [n_boot, docs]
    docs = rng.integers(0, len(tokens), size=(n_boot, len(tokens)))
    picked = np.take_along_axis(seeds_avg, docs, axis=1).sum(1)
    return picked / tokens[docs].sum(1)


def bootstrap_difference(sums_a, sums_b, tokens, n_boot: int, rng) -> np.ndarray:
    """Replicates of loss(a) - loss(b) on the same resampled documents (paired)."""
    diff = _resample_seeds(sums_a, n_boot, rng) - _resample_seeds(sums_b, n_boot, rng)
    docs = rng.integers(0, len(tokens), size=(n_boot, len(tokens)))
    return np.take_along_axis(diff, docs, axis=1).sum(1) / tokens[docs].sum(1)


def _resample_seeds(sums: np.ndarray, n_boot: int, rng) -> np.ndarray:
    if sums.shape[0] == 1:
        return np.broadcast_to(sums[0], (n_boot, sums.shape[1]))
    picks = rng.integers(0, sums.shape[0], size=(n_boot, sums.shape[0]))
    return sums[picks].mean(axis=1)


def interval(replicates: np.ndarray) -> tuple[float, float]:
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(replicates, [tail, 100 - tail])
    return float(low), float(high)


def verdict(low: float, high: float, floor: float | None = None) -> str:
    """``floor``: the training-noise floor (see the module docstring), when the sweep has one."""
    if low <= 0 <= high:
        return "within noise"
    if floor is not None and min(abs(low), abs(high)) <= floor:
        return "within training noise"
    return "differs"


def rounding_control(arms: list[tuple]) -> tuple[tuple, tuple] | None:
    """The two masked arms (reset and continuous positions, one packer): the same function up to
    rounding with RoPE, so their gap measures how far training amplifies rounding."""
    for packer in sorted({a[2] for a in arms}, key=str):
        pair = ((True, True, packer), (False, True, packer))
        if all(a in arms for a in pair):
            return pair
    return None


def apply_training_noise(pairs: list[dict], control: tuple[str, str] | None) -> dict | None:
    """Set each pair's verdict against the control pair's floor; the floor's description."""
    if control is None:
        return None
    pair = next(p for p in pairs if {p["a"], p["b"]} == set(control))
    floor = max(abs(pair["ci"][0]), abs(pair["ci"][1]))
    for p in pairs:
        p["verdict"] = "control" if p is pair else verdict(*p["ci"], floor)
    return {"a": pair["a"], "b": pair["b"], "floor": floor}


# ------------------------------------------------------------------------------ summary
def summarize(
    root: str | Path, n_boot: int = 2000, seed: int = 0, allow_mixed: bool = False
) -> dict:
    """Arms, pairwise differences and per-position bands of the runs under root."""
    runs = run_infos(root)
    check_comparable(runs, allow_mixed)
    frame = held_out_frame(runs)
    arms = ordered_arms(r.arm for r in runs)
    names = arm_names(arms)
    rng = np.random.default_rng(seed)
    matrices = {arm: loss_matrix(frame, arm) for arm in arms}
    summary = {
        "root": str(root),
        "runs": len(runs),
        "documents": int(frame["doc"].nunique()),
        "target_tokens": int(matrices[arms[0]][1].sum()),
        "bootstrap": {"replicates": n_boot, "confidence": CONFIDENCE, "seed": seed},
        "arms": [_arm_row(names[a], a, runs, *matrices[a], n_boot, rng) for a in arms],
        # every pair as (later arm - earlier arm): the first arm is the control
        "pairs": [
            _pair_row(names[later], names[earlier], matrices[later], matrices[earlier], n_boot, rng)
            for earlier, later in itertools.combinations(arms, 2)
        ],
        "control": names[arms[0]],
    }
    control = rounding_control(arms)
    summary["training_noise"] = apply_training_noise(
        summary["pairs"], control and (names[control[0]], names[control[1]])
    )
    versus_control = {p["a"]: p for p in summary["pairs"] if p["b"] == summary["control"]}
    for row in summary["arms"]:
        row["delta_vs_control"] = versus_control.get(row["arm"])
    summary["positions"] = position_bands(frame, names, n_boot, rng).to_dict("records")
    return summary


def _arm_row(name, arm, runs, sums, tokens, n_boot, rng) -> dict:
    own = [r for r in runs if r.arm == arm]
    low, high = interval(bootstrap_loss(sums, tokens, n_boot, rng))
    per_seed = sums.sum(1) / tokens.sum()
    return {
        "arm": name,
        "reset_position_ids": arm[0],
        "document_mask": arm[1],
        "packer": arm[2],
        "seeds": sorted(r.seed for r in own),
        "runs": [r.name for r in own],
        "loss": float(sums.mean(0).sum() / tokens.sum()),
        "ci": [low, high],
        "seed_losses": per_seed.tolist(),
        "seed_sd": float(per_seed.std(ddof=1)) if len(per_seed) > 1 else None,
    }


def _pair_row(name_a, name_b, a, b, n_boot, rng) -> dict:
    (sums_a, tokens), (sums_b, _) = a, b
    delta = float((sums_a.mean(0) - sums_b.mean(0)).sum() / tokens.sum())
    low, high = interval(bootstrap_difference(sums_a, sums_b, tokens, n_boot, rng))
    return {"a": name_a, "b": name_b, "delta": delta, "ci": [low, high],
            "verdict": verdict(low, high)}  # fmt: skip


def position_bands(frame: pd.DataFrame, names: dict, n_boot: int, rng) -> pd.DataFrame:
    """Per arm and in-document bucket: loss and its bootstrap CI over documents."""
    rows = []
    for (arm, start), part in frame.groupby([frame["arm"].map(names), "bucket_start"]):
        sums = part.groupby(["seed", "doc"])["loss_sum"].sum().unstack("doc").fillna(0.0)
        tokens = part.groupby("doc")["tokens"].sum().reindex(sums.columns) / sums.shape[0]
        replicates = bootstrap_loss(sums.to_numpy(), tokens.to_numpy(), n_boot, rng)
        low, high = interval(replicates)
        loss = float(sums.to_numpy().mean(0).sum() / tokens.sum())
        rows.append({"arm": arm, "bucket_start": int(start), "loss": loss, "low": low,
                     "high": high, "tokens": int(tokens.sum())})  # fmt: skip
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------- tables
def format_summary(summary: dict) -> str:
    """Markdown: the arm table (with Δ vs the control) and, with two arms or more, the pairs."""
    lines = [
        f"{summary['runs']} runs, {summary['documents']} held-out documents "
        f"({summary['target_tokens']:,} target tokens), {summary['bootstrap']['replicates']} "
        f"bootstrap replicates, {int(CONFIDENCE * 100)}% CIs; control: {summary['control']}",
        _noise_line(summary["training_noise"]),
        "",
        "| arm | seeds | held-out loss [95% CI] | seed sd | Δ vs control [95% CI] | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["arms"]:
        pair = row["delta_vs_control"]
        delta = "control" if pair is None else f"{pair['delta']:+.4f} {_ci(pair['ci'])}"
        sd = "n/a" if row["seed_sd"] is None else f"{row['seed_sd']:.4f}"
        lines.append(
            f"| {row['arm']} | {len(row['seeds'])} | {row['loss']:.4f} {_ci(row['ci'])} | {sd} "
            f"| {delta} | {'' if pair is None else pair['verdict']} |"
        )
    if not summary["pairs"]:
        lines += ["", "one arm only: no pairwise comparison"]
        return "\n".join(lines)
    lines += ["", "| a | b | a - b [95% CI] | verdict |", "|---|---|---|---|"]
    for pair in summary["pairs"]:
        lines.append(
            f"| {pair['a']} | {pair['b']} | {pair['delta']:+.4f} {_ci(pair['ci'])} "
            f"| {pair['verdict']} |"
        )
    return "\n".join(lines)


def _noise_line(noise: dict | None) -> str:
    if noise is None:
        return (
            "no rounding control (both masked arms) in this sweep: the CIs cover document sampling "
            "only, not training noise; add seeds (seed=0,1,...) before reading small gaps"
        )
    return (
        f"training-noise floor {noise['floor']:.4f} nats: the largest gap the control pair "
        f"({noise['a']} vs {noise['b']}: the same function up to rounding) allows"
    )


def _ci(ci: list[float]) -> str:
    return f"[{ci[0]:.4f}, {ci[1]:.4f}]"
