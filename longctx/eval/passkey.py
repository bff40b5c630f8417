"""The passkey probe: the ``lc_passkey`` task of the effective-length suite (longctx.eval.ruler).

A probe of length ``n`` is a prompt of ``n - 16`` tokens (the task's generation budget) with the
needle at ``depth``, then the question; the answer digits follow, teacher-forced (no generation
loop): a probe is correct when every answer token is the argmax. The filler is the suite's noise
haystack, so the same seed gives the same probes on every machine. This module keeps the
probe's own result rows (``passkey`` per probe) and table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from longctx.errors import LongctxError
from longctx.eval.ruler.generate import DEFAULT_DEPTHS, make_instance
from longctx.eval.ruler.instances import Instance
from longctx.eval.ruler.scoring import score_instances


def make_probe(
    tokenizer, length: int, depth: float, seed: int, sample: int = 0, digits: int = 5
) -> Instance:
    """One passkey probe of ``length`` input tokens with the needle at ``depth`` in [0, 1]; its
    ``answer`` is the passkey."""
    return make_instance("lc_passkey", tokenizer, length, depth, seed, sample, "noise", digits)


def make_probes(
    tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 4,
    seed: int = 0,
    digits: int = 5,
) -> list[Instance]:
    """Every (length, depth, sample) probe, in that order; deterministic given the seed."""
    if samples < 1:
        raise LongctxError(f"samples={samples}; expected >= 1")
    return [
        make_probe(tokenizer, n, d, seed, s, digits)
        for n in lengths
        for d in depths
        for s in range(samples)
    ]


@torch.no_grad()
def score_probes(
    model, probes: Sequence[Instance], batch_size: int = 4, device: str | torch.device = "cpu"
) -> list[dict]:
    """Per probe: length, depth, sample, passkey, correct (all answer tokens), token_accuracy."""
    keys = ("length", "depth", "sample", "passkey", "correct", "token_accuracy")
    rows = score_instances(model, probes, batch_size, device)  # teacher-forced
    named = {"passkey": "answer", "correct": "correct_teacher_forced"}
    return [{k: r[named.get(k, k)] for k in keys} for r in rows]


def accuracy_table(results: Sequence[dict]) -> list[dict]:
    """Mean accuracy per (length, depth): the needle heat map as rows."""
    cells: dict[tuple[int, float], list[dict]] = {}
    for r in results:
        cells.setdefault((r["length"], r["depth"]), []).append(r)
    return [
        {
            "length": n,
            "depth": d,
            "accuracy": sum(r["correct"] for r in rs) / len(rs),
            "token_accuracy": sum(r["token_accuracy"] for r in rs) / len(rs),
            "samples": len(rs),
        }
        for (n, d), rs in sorted(cells.items())
    ]
