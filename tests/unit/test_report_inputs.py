"""What a report reads from run folders is checked as it is read: a CSV with a non-numeric
score or a missing column, a damaged gzip archive, a ruler.json or run_record.json nested too
deep, is one line naming the file (and the column), never a traceback in the middle of a
report."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest
from helpers import write_run_record

from studies import analysis as A
from studies import ruler_report as R
from studies.sweep_files import read_table


def one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value), str(err.value)
    return str(err.value)


def ruler_run(root, rows: list[dict], cli: bool = False):
    run = write_run_record(root / "base_s0", {"seq_len": 128}, "base", 0)
    folder = run / "eval" / "ruler" if cli else run / "eval"
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "ruler_results.csv", index=False)
    return folder


ROW = {"step": 3, "task": "lc_passkey", "length": 64, "depth": 0.5, "sample": 0, "score": 1.0}


@pytest.mark.parametrize(
    "row, said",
    [
        ({**ROW, "score": "abc"}, r"column 'score' holds 'abc' \(row 2\), not a finite number"),
        ({k: v for k, v in ROW.items() if k != "score"}, "has no 'score' column"),
        ({k: v for k, v in ROW.items() if k != "task"}, "has no 'task' column"),
        ({**ROW, "score": float("inf")}, r"column 'score' holds inf \(row 2\)"),
        ({**ROW, "score": None}, r"column 'score' holds an empty cell \(row 2\)"),  # an empty cell
    ],
)
def test_a_results_csv_with_a_bad_column_names_file_and_column(tmp_path, row, said):
    folder = ruler_run(tmp_path, [row])
    with pytest.raises(ValueError, match=said) as err:
        R.load_results(tmp_path, "group")
    assert str(folder / "ruler_results.csv") in one_line(err)


def test_a_results_csv_of_a_header_alone_is_one_line(tmp_path):
    folder = ruler_run(tmp_path, [ROW])
    (folder / "ruler_results.csv").write_text(",".join(ROW) + "\n")
    with pytest.raises(ValueError, match="ruler_results.csv holds no rows") as err:
        R.load_results(tmp_path, "group")
    one_line(err)


def test_a_cli_ruler_json_nested_too_deep_or_without_its_seed_is_one_line(tmp_path):
    row = {k: v for k, v in ROW.items() if k != "step"}  # the CLI's: its seed in ruler.json
    folder = ruler_run(tmp_path, [row], cli=True)
    (folder / "ruler.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"ruler\.json cannot be read as the suite's ruler\.json "
                       r"\(RecursionError") as err:  # fmt: skip
        R.load_results(tmp_path, "group")
    one_line(err)
    (folder / "ruler.json").write_text(json.dumps({"settings": {}}))
    with pytest.raises(ValueError, match="has no integer settings.instance_seed"):
        R.load_results(tmp_path, "group")
    (folder / "ruler.json").write_text(json.dumps({"settings": {"instance_seed": 4}}))
    assert set(R.load_results(tmp_path, "group")["seed"]) == {4}


def test_a_damaged_gzip_metrics_log_is_named(tmp_path):
    """An archived run's csv/metrics.csv.gz that is not gzip, or is cut short."""
    run = write_run_record(tmp_path / "r", {"reset_position_ids": True, "document_mask": True},
                           "position_ablation", 0)  # fmt: skip
    (run / "csv").mkdir()
    log = run / "csv" / "metrics.csv.gz"
    whole = gzip.compress(b"epoch,step,train/loss\n" + b"0,1,4.0\n" * 5000)
    for damaged in (b"not gzip at all", whole[: len(whole) // 2]):
        log.write_bytes(damaged)
        with pytest.raises(ValueError, match="cannot be read as a gzip-compressed CSV") as err:
            A.load_local(tmp_path)
        assert str(log) in one_line(err)
    log.write_bytes(gzip.compress(b"epoch,step,train/loss\n0,1,four\n"))
    with pytest.raises(ValueError, match=r"column 'train/loss' holds 'four'"):
        A.load_local(tmp_path)


def test_a_run_record_nested_too_deep_is_one_line(tmp_path):
    from longctx.hf.config_targets import CONFIG_TARGETS
    from longctx.runs.record import RecordError
    from studies.sweep_files import read_record_file

    (tmp_path / "run_record.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(RecordError, match="is not a readable run record") as err:
        read_record_file(tmp_path / "run_record.json", CONFIG_TARGETS)
    one_line(err)


def test_read_table_passes_a_good_file_through(tmp_path):
    path = tmp_path / "t.csv"
    pd.DataFrame([{"a": 1, "b": "x"}, {"a": None, "b": "y"}]).to_csv(path, index=False)
    frame = read_table(path, text=["b"], sparse=True)  # a metrics log: empty cells are fine
    assert frame["a"].iloc[0] == 1 and frame["a"].isna().iloc[1]
    with pytest.raises(ValueError, match=r"column 'a' holds an empty cell \(row 3\)"):
        read_table(path, numeric=["a"])
