"""One error base (issue 50, item 4): every exception class of longctx is a LongctxError unless
longctx.errors names it as no refusal, and the command lines end in one line (exit 2) on a
LongctxError only: any other ValueError, a bug, keeps its traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys

import pandas as pd
import pytest
from helpers import FAST, compose

import longctx
import studies
from longctx import errors
from longctx.cli import USER_ERRORS, command
from longctx.errors import LongctxError
from longctx.train import app
from studies import analysis

NOT_REFUSALS = set(re.findall(r"``(longctx\.[\w.]+)``", errors.__doc__))


def longctx_exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class a module of longctx or of studies defines, by its dotted name."""
    found = {}
    modules = [
        *pkgutil.walk_packages(longctx.__path__, "longctx."),
        *pkgutil.walk_packages(studies.__path__, "studies."),
    ]
    for info in modules:
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_is_a_refusal_or_named_as_none():
    classes = longctx_exception_classes()
    stray = sorted(
        name
        for name, cls in classes.items()
        if not issubclass(cls, LongctxError) and name not in NOT_REFUSALS
    )
    assert not stray, f"subclass LongctxError, or name them in longctx.errors' docstring: {stray}"
    # the list stays true: each name is a class of longctx that is indeed no LongctxError
    assert classes.keys() >= NOT_REFUSALS, sorted(NOT_REFUSALS - classes.keys())
    assert not [n for n in NOT_REFUSALS if issubclass(classes[n], LongctxError)]


def test_the_commands_catch_refusals_and_paths_only():
    assert (LongctxError, OSError) == USER_ERRORS
    assert issubclass(LongctxError, ValueError)  # callers catching ValueError keep working


def test_a_command_ends_a_refusal_in_one_line_and_lets_a_bug_through(capsys):
    def refuses():
        raise LongctxError("x=3; expected an even number")

    def has_a_bug():
        raise ValueError("an internal invariant broke")

    with pytest.raises(SystemExit) as stopped:
        command(refuses)()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: x=3; expected an even number\n"
    with pytest.raises(ValueError, match="an internal invariant broke"):
        command(has_a_bug)()
    assert capsys.readouterr().err == ""


def figure_that_raises(error: Exception):
    def ablation_figure(*args, **kwargs):
        raise error

    return ablation_figure


def test_the_analysis_command_says_a_refusal_and_keeps_a_bugs_traceback(
    tmp_path, monkeypatch, capsys
):
    """Deep in a command (the figure, behind the CLI's own catch of refusals): a LongctxError
    is one line and exit 2; a plain ValueError propagates, as a bug."""
    monkeypatch.setattr(analysis, "load_local", lambda folder: pd.DataFrame())
    argv = [str(tmp_path), "--out", str(tmp_path / "a.png")]
    monkeypatch.setattr(analysis, "ablation_figure", figure_that_raises(LongctxError("no rows")))
    with pytest.raises(SystemExit) as stopped:
        analysis.cli(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: no rows\n"
    monkeypatch.setattr(analysis, "ablation_figure", figure_that_raises(ValueError("a bug")))
    with pytest.raises(ValueError, match="^a bug$"):
        analysis.cli(argv)
    assert "error: " not in capsys.readouterr().err


def test_a_bug_run_as_a_command_prints_its_traceback_and_exits_1(tmp_path):
    script = (
        "import sys\n"
        "import pandas as pd\n"
        "from studies import analysis\n"
        "def figure(*args, **kwargs):\n"
        "    raise ValueError('a bug deep in the figure')\n"
        "analysis.load_local = lambda folder: pd.DataFrame()\n"
        "analysis.ablation_figure = figure\n"
        "analysis.cli(sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), "--out", str(tmp_path / "a.png")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "ValueError: a bug deep in the figure"
    assert "error: " not in done.stderr


@pytest.mark.parametrize(
    "error, exits", [(LongctxError("data.thing=1; expected 2"), True), (ValueError("bug"), False)]
)
def test_train_py_says_a_refusal_and_keeps_a_bugs_traceback(
    error, exits, tmp_path, monkeypatch, capsys
):
    """train.py's entry (longctx.train.app.main), with the data module's build raising."""

    def build_datamodule(*args, **kwargs):
        raise error

    monkeypatch.setattr(app, "build_datamodule", build_datamodule)
    cfg = compose([*FAST], output_dir=tmp_path / "run")
    if exits:
        with pytest.raises(SystemExit) as stopped:
            app.main(cfg)
        assert stopped.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {error}"
    else:
        with pytest.raises(ValueError, match="^bug$"):
            app.main(cfg)
        assert "error: " not in capsys.readouterr().err
