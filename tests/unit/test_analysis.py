"""studies.analysis: tidy frames from CSV logs, offline W&B run files and the W&B API; plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import write_run_record

from studies import analysis as A

VARIANTS = [(True, True), (False, True), (True, False), (False, False)]


def write_run(root: Path, reset: bool, mask: bool) -> Path:
    """A run folder as train.py leaves it: its checkpoint's record (+ logs written by the
    caller)."""
    run = root / f"data.document_mask={mask},data.reset_position_ids={reset}"
    data = {"reset_position_ids": reset, "document_mask": mask}
    return write_run_record(run, data, group="position_ablation")


def fake_loss(reset: bool, mask: bool, step: int) -> float:
    return 5.0 - 0.01 * step + 0.1 * reset + 0.2 * mask


def write_csv_log(run: Path, reset: bool, mask: bool) -> None:
    rows = [{"epoch": 0, "step": s, "train/loss": fake_loss(reset, mask, s)} for s in range(6)]
    rows.append({"epoch": 0, "step": 5, "val/loss": 4.0, "val/loss_by_abs_pos/0": 5.5,
                 "val/loss_by_abs_pos/1": 4.5, "val/loss_by_doc_pos/0": 6.0 - mask})  # fmt: skip
    (run / "csv").mkdir()
    pd.DataFrame(rows).to_csv(run / "csv" / "metrics.csv", index=False)


@pytest.fixture
def csv_runs(tmp_path):
    for reset, mask in VARIANTS:
        write_csv_log(write_run(tmp_path, reset, mask), reset, mask)
    return tmp_path


def test_csv_runs_make_a_tidy_frame(csv_runs):
    frame = A.load_local(csv_runs)
    assert list(frame.columns) == A.COLUMNS
    assert frame["run"].nunique() == 4 and set(frame["group"]) == {"position_ablation"}
    assert set(frame["variant"]) == {A.arm_label(r, m) for r, m in VARIANTS}
    loss = frame[(frame.metric == "train/loss") & frame.reset_position_ids & ~frame.document_mask]
    assert loss["step"].tolist() == list(range(6))
    assert loss["value"].tolist() == pytest.approx([fake_loss(True, False, s) for s in range(6)])
    assert "epoch" not in set(frame["metric"]) and frame["value"].notna().all()
    positions = A.position_frame(frame)
    assert len(positions) == 4 * 3
    doc = positions[(positions.kind == "doc") & positions.document_mask]
    assert doc["loss"].tolist() == [5.0, 5.0] and set(positions["step"]) == {5}


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run folders"):
        A.load_local(tmp_path)
    write_run(tmp_path, True, True)
    with pytest.raises(FileNotFoundError, match="csv/metrics.csv"):
        A.load_local(tmp_path)
    with pytest.raises(ValueError, match="document_mask=None"):
        A.tidy_frame([], "r", None, {"reset_position_ids": True})


# ------------------------------------------------------------------------ W&B public API
class FakeRun:
    def __init__(self, name, reset, mask):
        self.id, self.name, self.group = name, name, "position_ablation"
        self.config = {"data": {"reset_position_ids": reset, "document_mask": mask}}
        self._reset = reset

    def scan_history(self):
        for step in range(3):
            yield {"_step": 10 + step, "trainer/global_step": step, "_runtime": 1.0,
                   "train/loss": 4.0 - step + self._reset, "val/loss": None}  # fmt: skip
        yield {"_step": 13, "table": {"_type": "table-file"}}  # no trainer step: W&B's _step


class FakeApi:
    def __init__(self):
        self.calls = []

    def runs(self, path, filters):
        self.calls.append((path, filters))
        return [FakeRun("a", True, True), FakeRun("b", False, True)]


def test_wandb_api_runs_make_the_same_frame():
    api = FakeApi()
    frame = A.load_wandb("me/longctx", "position_ablation", api=api)
    assert api.calls == [("me/longctx", {"group": "position_ablation"})]
    assert list(frame.columns) == A.COLUMNS
    a = frame[frame.run == "a"]
    assert a[["step", "metric", "value"]].values.tolist() == [
        [0, "train/loss", 5.0], [1, "train/loss", 4.0], [2, "train/loss", 3.0],
    ]  # fmt: skip
    assert set(frame["variant"]) == {A.arm_label(True, True), A.arm_label(False, True)}


def test_wandb_api_empty_group_is_an_error():
    class Empty(FakeApi):
        def runs(self, path, filters):
            return []

    with pytest.raises(LookupError, match="no runs in group 'g'"):
        A.load_wandb("me/longctx", "g", api=Empty())


# --------------------------------------------------------------------------------- plots
def test_ema_equals_the_debiased_recurrence():
    """pandas ewm(adjust=True) is W&B's debiased EMA: the recurrence it replaced."""
    values = np.random.default_rng(0).normal(3.0, 1.0, 50)
    for smoothing in (0.0, 0.5, 0.9, 0.99):
        acc, weight, expected = 0.0, 0.0, []
        for v in values:
            acc = smoothing * acc + (1 - smoothing) * v
            weight = smoothing * weight + (1 - smoothing)
            expected.append(acc / weight)
        assert A.ema(values, smoothing) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_ema_is_debiased():
    assert A.ema([2.0, 2.0, 2.0], 0.9).tolist() == pytest.approx([2.0, 2.0, 2.0])
    assert A.ema([0.0, 1.0], 0.5).tolist() == pytest.approx([0.0, 0.5 / 0.75])
    with pytest.raises(ValueError, match="smoothing=1.0"):
        A.ema([1.0], 1.0)


def test_plots_are_written_as_png(csv_runs, tmp_path):
    frame = A.load_local(csv_runs)
    out = A.save_figure(A.ablation_figure(frame, "t"), tmp_path / "fig" / "ablation.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    probes = pd.DataFrame(
        [{"length": n, "depth": d, "accuracy": float(r), "reset_position_ids": r,
          "document_mask": True} for n in (128, 256) for d in (0.0, 1.0) for r in (True, False)]
    )  # fmt: skip
    heat = A.save_figure(A.plot_retrieval_heatmaps(probes), tmp_path / "heat.png")
    assert heat.stat().st_size > 1000
    with pytest.raises(ValueError, match="no rows for metric 'nope'"):
        A.plot_training_curves(frame, "nope")
    with pytest.raises(ValueError, match="kind='row'"):
        A.plot_position_loss(frame, "row")


def test_cli_writes_the_figure_and_needs_held_out_losses_for_the_verdicts(csv_runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no held-out document losses"):
        A.main([str(csv_runs), "--out", str(tmp_path / "a.png")])
    assert (tmp_path / "a.png").is_file()  # the curves are drawn before the verdicts are refused
    with pytest.raises(ValueError, match="either a local FOLDER"):
        A.main([])


def test_runs_without_validation_are_named(tmp_path, capsys):
    run = write_run(tmp_path, True, True)
    (run / "csv").mkdir()
    pd.DataFrame([{"epoch": 0, "step": s, "train/loss": 3.0} for s in range(3)]).to_csv(
        run / "csv" / "metrics.csv", index=False
    )
    with pytest.raises(SystemExit) as stop:
        A.cli([str(tmp_path), "--out", str(tmp_path / "a.png")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path}: no per-position loss metrics")
    assert run.name in err and "never validated" in err and "\n" not in err


def test_a_bootstrap_of_no_replicates_is_refused_before_the_figure(csv_runs, tmp_path):
    with pytest.raises(ValueError, match="--bootstrap 0; expected a count of replicates"):
        A.main([str(csv_runs), "--out", str(tmp_path / "a.png"), "--bootstrap", "0"])
    assert not (tmp_path / "a.png").exists()
