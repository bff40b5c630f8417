"""Signal or noise: each arm's held-out loss and every pair's difference, with bootstrap CIs.

The input is what :class:`longctx.eval.callbacks.HeldOutDocumentLoss` writes into each run folder:
loss sums per (held-out document, in-document position bucket), the same documents for every arm.
The hierarchical bootstrap of :mod:`studies.statistics` (training seeds resampled, then
documents within each drawn seed; two arms paired by seed where they share their seeds) gives

- per arm: the token-weighted held-out loss with its 95% CI;
- per pair of arms: the paired difference on the same seeds and documents, its CI and a verdict,
  and beside it the seed-level t interval over the per-seed differences with their signs (with
  three seeds the bootstrap cannot reach beyond the per-seed range; claims take the wider);
- the same on the answer tokens of held-out long-range documents (the loss that needs
  retrieval, :mod:`longctx.eval.answer_loss`), where the runs scored them;
- the training-noise floor: resampling documents says whether two *trained models* differ, not
  whether two *arms* do. Training amplifies rounding: the two masked arms compute the same function
  up to ~1e-6, agree bitwise for the first few dozen steps and then drift apart (a 300-step run ends
  ~0.01 nats apart). So the masked pair is the sweep's control: the largest gap its CI allows is
  the floor below which a difference between arms is indistinguishable from rounding noise.
  Verdicts: "within noise" (the CI covers 0), "within training noise" (the CI reaches below the
  floor), "differs" (beyond both);
- per arm with several seeds: the seed-to-seed spread of the run losses;
- per arm and position bucket: the loss with its CI (the bands of the per-position figure).

An arm is a run's (reset_position_ids, document_mask, packer); :mod:`longctx.data.arms` names it.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pandas as pd

from longctx.data.arms import ARM_ORDER, arm_label
from longctx.errors import LongctxError
from longctx.eval.files import EVAL_DIR, HELD_OUT_ANSWERS_CSV, HELD_OUT_DOCUMENTS_CSV
from studies import statistics as st
from studies.sweep_files import read_table, require_runs, run_name, run_settings

HELD_OUT_FILE = Path(EVAL_DIR) / HELD_OUT_DOCUMENTS_CSV
ANSWERS_FILE = Path(EVAL_DIR) / HELD_OUT_ANSWERS_CSV  # longctx.eval.answer_loss
ARM_KEYS = ("reset_position_ids", "document_mask", "packer")


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
            raise LongctxError(f"run {name} has seed={seed!r} in its config; expected an int")
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
            raise LongctxError(
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
        data = read_table(path, numeric=["step", "bucket_start", "tokens", "loss_sum"],
                          text=["doc"])  # fmt: skip
        data = data[data["step"] == data["step"].max()]
        frames.append(data.assign(run=run.name, arm=[run.arm] * len(data), seed=run.seed))
    frame = pd.concat(frames, ignore_index=True)
    _check_same_documents(frame)
    return frame


def _check_same_documents(frame: pd.DataFrame) -> None:
    tokens = frame.groupby(["run", "doc"])["tokens"].sum().unstack("run")
    if tokens.isna().any().any() or not (tokens.nunique(axis=1) == 1).all():
        raise LongctxError(
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


def per_instance(root: str | Path) -> pd.DataFrame:
    """Every run's per-document rows at its last validation (the bootstrap's input), held-out
    documents (``set`` "held_out") and answer tokens ("answers") where scored: what the summary's
    numbers are recomputed from."""
    runs = run_infos(root)
    names = arm_names(ordered_arms(r.arm for r in runs))
    parts = [held_out_frame(runs).assign(set="held_out")]
    for run in runs:
        if (run.folder / ANSWERS_FILE).is_file():
            answers = _last_step(read_answers(run.folder))
            parts.append(answers.assign(set="answers", run=run.name, arm=[run.arm] * len(answers),
                                        seed=run.seed))  # fmt: skip
    frame = pd.concat(parts, ignore_index=True)
    return frame.assign(arm=frame["arm"].map(names))


# ---------------------------------------------------------------------------- bootstrap
def arm_sample(frame: pd.DataFrame, arm: tuple) -> st.ArmSample:
    """One arm's loss sums over tokens, [seeds, documents] (documents in a fixed order)."""
    rows = frame[frame["arm"].apply(lambda a: a == arm)]
    return st.arm_sample(rows, "loss_sum", "tokens", ["doc"])


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
    """Arms, pairwise differences and per-position bands of the runs under root (the held-out
    loss), and the same on the held-out answer tokens where the runs scored them."""
    runs = run_infos(root)
    check_comparable(runs, allow_mixed)
    frame = held_out_frame(runs)
    arms = ordered_arms(r.arm for r in runs)
    names = arm_names(arms)
    rng = np.random.default_rng(seed)
    samples = {arm: arm_sample(frame, arm) for arm in arms}
    summary = {
        "root": str(root),
        "runs": len(runs),
        "documents": int(frame["doc"].nunique()),
        "target_tokens": int(samples[arms[0]].weights[0].sum()),
        "bootstrap": {
            "replicates": n_boot,
            "confidence": st.CONFIDENCE,
            "seed": seed,
            "method": BOOTSTRAP_METHOD,
        },  # fmt: skip
        "arms": [_arm_row(names[a], a, runs, samples[a], n_boot, rng) for a in arms],
        **_pairs(arms, names, samples, n_boot, rng),
    }
    control = rounding_control(arms)
    summary["training_noise"] = apply_training_noise(
        summary["pairs"], control and (names[control[0]], names[control[1]])
    )
    versus_control = {p["a"]: p for p in summary["pairs"] if p["b"] == summary["control"]}
    for row in summary["arms"]:
        row["delta_vs_control"] = versus_control.get(row["arm"])
    summary["positions"] = position_bands(frame, names, n_boot, rng).to_dict("records")
    summary["answer_loss"] = answer_loss_summary(runs, arms, names, n_boot, rng)
    return summary


BOOTSTRAP_METHOD = (
    "hierarchical: training seeds resampled, then documents within each drawn seed; arm "
    "differences paired (one draw for both arms) where the arms share their seeds"
)


def _pairs(arms: list[tuple], names: dict, samples: dict, n_boot: int, rng) -> dict:
    """Every pair as (later arm - earlier arm): the first arm is the control."""
    pairs = [
        _pair_row(names[later], names[earlier], samples[later], samples[earlier], n_boot, rng)
        for earlier, later in itertools.combinations(arms, 2)
    ]
    return {"pairs": pairs, "control": names[arms[0]]}


def _arm_row(name, arm, runs, sample: st.ArmSample, n_boot, rng) -> dict:
    own = [r for r in runs if r.arm == arm]
    low, high = st.interval(st.bootstrap(sample, n_boot, rng))
    per_seed = np.array(list(sample.per_seed().values()))
    return {
        "arm": name,
        "reset_position_ids": arm[0],
        "document_mask": arm[1],
        "packer": arm[2],
        "seeds": sorted(r.seed for r in own),
        "runs": [r.name for r in own],
        "loss": sample.estimate,
        "ci": [low, high],
        "seed_losses": per_seed.tolist(),
        "seed_sd": float(per_seed.std(ddof=1)) if len(per_seed) > 1 else None,
    }


def _pair_row(name_a, name_b, a: st.ArmSample, b: st.ArmSample, n_boot, rng) -> dict:
    row = st.difference(a, b, n_boot, rng, paired=st.shares_seeds(a, b))
    return {"a": name_a, "b": name_b, **row, "verdict": verdict(*row["ci"])}


def position_bands(frame: pd.DataFrame, names: dict, n_boot: int, rng) -> pd.DataFrame:
    """Per arm and in-document bucket: loss and its bootstrap CI over seeds and documents."""
    rows = []
    for (arm, start), part in frame.groupby([frame["arm"].map(names), "bucket_start"]):
        sample = st.arm_sample(part, "loss_sum", "tokens", ["doc"])
        low, high = st.interval(st.bootstrap(sample, n_boot, rng))
        rows.append({"arm": arm, "bucket_start": int(start), "loss": sample.estimate, "low": low,
                     "high": high, "tokens": int(sample.weights[0].sum())})  # fmt: skip
    return pd.DataFrame(rows)


def answer_loss_summary(runs: list[RunInfo], arms, names: dict, n_boot: int, rng) -> dict | None:
    """The loss on the answer tokens of held-out long-range documents (retrieval's loss,
    longctx.eval.answer_loss), per arm and pair; None when the runs did not score it."""
    if not all((r.folder / ANSWERS_FILE).is_file() for r in runs):
        return None
    parts = [_last_step(read_answers(r.folder)).assign(run=r.name, seed=r.seed)
             for r in runs]  # fmt: skip
    frame = pd.concat(parts, ignore_index=True)
    frame["arm"] = frame["run"].map({r.name: r.arm for r in runs})
    # per task too: the tasks differ in how much retrieval predicts (a span copied after
    # "Recite:" against a value found through three hops), which the pooled loss mixes
    return {**_answer_rows(frame, arms, names, n_boot, rng),
            "tasks": {task: _answer_rows(part, arms, names, n_boot, rng)
                      for task, part in frame.groupby("task")}}  # fmt: skip


def _answer_rows(frame: pd.DataFrame, arms, names: dict, n_boot: int, rng) -> dict:
    samples = {arm: arm_sample(frame, arm) for arm in arms}
    first = samples[arms[0]]
    return {
        "documents": len(first.instances),
        "answer_tokens": int(first.weights[0].sum()),
        "arms": [{"arm": names[a], "loss": samples[a].estimate,
                  "ci": list(st.interval(st.bootstrap(samples[a], n_boot, rng))),
                  "seed_losses": list(samples[a].per_seed().values())} for a in arms],
        **_pairs(arms, names, samples, n_boot, rng),
    }  # fmt: skip


def read_answers(folder: Path) -> pd.DataFrame:
    return read_table(folder / ANSWERS_FILE, numeric=["step", "tokens", "loss_sum"],
                      text=["doc", "task"])  # fmt: skip


def _last_step(data: pd.DataFrame) -> pd.DataFrame:
    return data[data["step"] == data["step"].max()]


# ------------------------------------------------------------------------------- tables
def format_summary(summary: dict) -> str:
    """Markdown: the arm table (with Δ vs the control) and, with two arms or more, the pairs."""
    lines = [
        f"{summary['runs']} runs, {summary['documents']} held-out documents "
        f"({summary['target_tokens']:,} target tokens), {summary['bootstrap']['replicates']} "
        f"bootstrap replicates, {int(st.CONFIDENCE * 100)}% CIs; control: {summary['control']}",
        _noise_line(summary["training_noise"]),
        "",
        "| arm | seeds | held-out loss [95% CI] | seed sd | Δ vs control [95% CI] "
        "| seed-level t 95% CI (signs) | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["arms"]:
        pair = row["delta_vs_control"]
        delta = (
            "control | "
            if pair is None
            else (f"{pair['delta']:+.4f} {_ci(pair['ci'])} | {st.seed_level_text(pair)}")
        )
        sd = "n/a" if row["seed_sd"] is None else f"{row['seed_sd']:.4f}"
        lines.append(
            f"| {row['arm']} | {len(row['seeds'])} | {row['loss']:.4f} {_ci(row['ci'])} | {sd} "
            f"| {delta} | {'' if pair is None else pair['verdict']} |"
        )
    if not summary["pairs"]:
        lines += ["", "one arm only: no pairwise comparison"]
        return "\n".join(lines)
    lines += ["", *pairs_table(summary["pairs"], "a - b [95% CI]")]
    answers = summary.get("answer_loss")
    if answers:
        lines += ["", f"held-out answer tokens (retrieval's loss): {answers['documents']} "
                  f"documents, {answers['answer_tokens']:,} answer tokens", "",
                  "| arm | answer loss [95% CI] |", "|---|---|"]  # fmt: skip
        lines += [f"| {r['arm']} | {r['loss']:.4f} {_ci(r['ci'])} |" for r in answers["arms"]]
        lines += ["", *pairs_table(answers["pairs"], "answer loss a - b [95% CI]")]
        lines += ["", *_task_table(answers["tasks"])]
    return "\n".join(lines)


def _task_table(tasks: dict) -> list[str]:
    """Answer loss per task (rows) and arm (columns)."""
    arms = [r["arm"] for r in next(iter(tasks.values()))["arms"]]
    lines = [f"| task (answer tokens) | {' | '.join(arms)} |", "|---|" + "---|" * len(arms)]
    for task, rows in tasks.items():
        cells = " | ".join(f"{r['loss']:.3f} {_ci(r['ci'])}" for r in rows["arms"])
        lines.append(f"| {task} ({rows['answer_tokens']:,}) | {cells} |")
    return lines


def pairs_table(pairs: list[dict], what: str) -> list[str]:
    """Beside the bootstrap interval, the seed-level t interval over the per-seed differences and
    their signs: with few seeds the bootstrap cannot reach beyond the per-seed range, so a claim
    is worded by the wider of the two."""
    lines = [f"| a | b | {what} | seed-level t 95% CI (signs) | paired | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for pair in pairs:
        paired = f"by seed ({pair['seeds']})" if pair["paired"] else "no (other seeds)"
        lines.append(f"| {pair['a']} | {pair['b']} | {pair['delta']:+.4f} {_ci(pair['ci'])} "
                     f"| {st.seed_level_text(pair)} | {paired} | {pair['verdict']} |")  # fmt: skip
    return lines


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
