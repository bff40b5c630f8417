"""The in-loop suite at scale (ruler_sharded_script.py, 2 gloo processes): instances dealt over
two data-parallel replicas (with the model sharded by FSDP2 too: its forward passes stay in
step), and each instance split over a context-parallel group of two, give
every rank the rows one process gives: same order, same generated text, same scores, in both
scoring modes. And the replicas' shares keep every rank in step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import SCRIPTS

from longctx.eval.ruler.callback import replica_share

SCRIPT = SCRIPTS / "ruler_sharded_script.py"
COMPARED = ("task", "length", "sample", "prediction", "score", "correct_teacher_forced",
            "token_accuracy", "scoring")  # fmt: skip


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [
        json.loads(line)
        for rank in (0, 1)
        for line in Path(f"{out}.{rank}").read_text().splitlines()
    ]
    return {(line["case"], line["rank"]): line["rows"] for line in lines}


def view(rows):
    return [{k: r[k] for k in COMPARED} for r in rows]


@pytest.mark.parametrize("mode", ["teacher_forced", "generate"])
@pytest.mark.parametrize("layout", ["dp2", "cp2", "fsdp2"])
def test_two_ranks_give_the_scores_of_one(cases, layout, mode):
    single = view(cases[(f"single {mode}", 0)])
    assert len(single) == 7 and all(r["scoring"] == mode for r in single)
    if mode == "generate":  # the random model writes text, so equal rows are not trivially so
        assert len({r["prediction"] for r in single}) > 1
    for rank in (0, 1):
        assert view(cases[(f"{layout} {mode}", rank)]) == single, f"rank {rank}"


def test_replica_shares_cover_every_instance_and_keep_ranks_in_step():
    shapes = [(10, 8, 2), (10, 8, 2), (20, 15, 6), (10, 8, 2), (20, 15, 6), (30, 28, 3)]
    instances = [
        SimpleNamespace(tokens=[0] * n, prompt=[0] * p, tokens_to_generate=g) for n, p, g in shapes
    ]
    shares = [replica_share(instances, rank, 4) for rank in range(4)]
    assert sorted(set().union(*shares)) == list(range(len(shapes)))
    # every replica: the same sequence of batch shapes (so the same forward passes)
    sequences = [[shapes[i] for i in share] for share in shares]
    assert all(s == sequences[0] for s in sequences)
    assert shares[0] == [0, 2, 5] and shares[3] == [0, 2, 5]  # padded with own or the first
    assert shares[1] == [1, 4, 5]
