"""The one task registry (longctx.synthetic.tasks): every task once, with its family, and what
each reader (the suite, the synthesizer, the held-out answer loss) takes from it."""

from __future__ import annotations

import pytest

from longctx.synthetic import TaskInputError, mqar
from longctx.synthetic.tasks import (
    FAMILIES,
    RULER_TASKS,
    SUITE_TASKS,
    TASKS,
    USES,
    check_tasks,
    names_of,
)


def test_every_family_is_registered_under_its_names():
    assert len(RULER_TASKS) == 13 and RULER_TASKS[0] == "niah_single_1"
    assert names_of("dense") == ("kv_recall", "copy", "repeat")
    assert names_of("ood") == ("ood_ledger", "ood_locker", "ood_relay", "ood_echo")
    assert names_of("mqar") == (mqar.KIND,)
    assert all(name.startswith("lc_") for name in names_of("lc")) and len(names_of("lc")) == 9
    assert sorted(TASKS) == sorted(n for f in FAMILIES for n in names_of(f))


def test_each_reader_takes_its_families():
    assert names_of("ruler", "lc") == SUITE_TASKS
    assert USES["suite"].known == SUITE_TASKS and USES["suite"].default == RULER_TASKS
    assert USES["synthesize"].known == names_of("dense", "ood", "lc")
    assert USES["answer_loss"].known == USES["answer_loss"].default == names_of("ood")
    assert mqar.KIND not in {n for use in USES.values() for n in use.known}


def test_check_tasks_parses_defaults_and_refuses():
    assert check_tasks(None, "suite") == list(RULER_TASKS)
    assert check_tasks("copy, kv_recall,copy", "synthesize") == ["copy", "kv_recall"]
    with pytest.raises(TaskInputError, match="none given"):
        check_tasks(None, "synthesize")  # a mix names its tasks
    with pytest.raises(TaskInputError, match=r"unknown task \('niah_single_1'\)"):
        check_tasks(["niah_single_1"], "synthesize")  # the suite's formats are never trained on
    with pytest.raises(TaskInputError, match=r"unknown task \('kv_recall'\)"):
        check_tasks(["kv_recall"], "suite")
