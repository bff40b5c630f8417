"""The leak probe through context-parallel shards over 2 gloo processes (probe_cp_script.py):
it passes on sdpa and eager, reset and continuous positions, one and two head-tail rounds, and
names each injected bug: boundaries dropped under CP, positions restarting at chunk edges,
attention causal over the whole row."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import SCRIPTS

SCRIPT = SCRIPTS / "probe_cp_script.py"
EXPECTED = {
    "-": "PASS",
    "drop_cp_boundaries": "FAIL isolation/logits row 0, document 1 (tokens 5:35) moved by",
    "causal_row": "FAIL isolation/logits row 0, document 1 (tokens 5:35) moved by",
    "reset_at_chunk_edges": "FAIL positions row 0, document 1 (tokens 5:35)",
}


@pytest.mark.parametrize("rounds", [1, 2])
def test_probe_over_context_parallel_ranks(rounds):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "2", str(rounds)],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    cases = [f"{b} {a} {bug}" for b in ("sdpa", "eager") for a in ("reset", "continuous")
             for bug in EXPECTED]  # fmt: skip
    assert sorted(lines) == sorted(cases), proc.stdout
    for case, verdict in lines.items():
        assert verdict.startswith(EXPECTED[case.rsplit(" ", 1)[1]]), f"{case}: {verdict}"
    # the chunk edge (24 with one round, 12 with two) is where positions restart
    edge = 24 // rounds
    restarted = lines["sdpa continuous reset_at_chunk_edges"]
    assert f"the first, at token {edge}, is 0, expected {edge}" in restarted, restarted
