"""The leak probe on every attention backend of this machine, in float32 and bfloat16: no Hydra, no
Lightning, no corpus (the GPU check runs it where neither is installed).

    python -m longctx.probe.backends --device cuda --backends flash,flex,sdpa --out DIR

A random-init Llama (the ``tiny`` preset's shape) on synthetic rows: documents of a few lengths
that straddle FlexAttention's 128-token blocks, one longer than a block, a one-token one, and a
pad tail. A backend the device or dtype cannot run (flash in fp32, flash or flex compiled on a
CPU) is listed as skipped with the reason. Prints one summary table, writes
``backends.json`` (every case's full report); exit 0 when every probed case passes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from longctx.batch import IGNORE_INDEX, PackedBatch
from longctx.cli import command
from longctx.dtypes import dtype_named
from longctx.io import atomic_write_text
from longctx.model import Llama, LlamaConfig
from longctx.probe.checks import ProbeRows, Target, packed_lm_forward, probe
from longctx.probe.report import Report

# row lengths of segments: few distinct lengths, so a compiled kernel compiles few shapes for
# the documents run alone; every row sums to its length with the pad tail last
DOCUMENT_LENGTHS = (300, 1, 77, 500, 77, 300)


def synthetic_rows(length: int, rows: int, vocab_size: int, seed: int = 0) -> ProbeRows:
    """``rows`` rows of ``length`` tokens: the documents in turn (row r starts at document r),
    as many as fit, then a pad tail of what is left (at least one token)."""
    gen = torch.Generator().manual_seed(seed)
    lengths, pads = [], []
    for r in range(rows):
        row, used, i = [], 0, r
        while used + DOCUMENT_LENGTHS[i % len(DOCUMENT_LENGTHS)] < length:
            row.append(DOCUMENT_LENGTHS[i % len(DOCUMENT_LENGTHS)])
            used, i = used + row[-1], i + 1
        lengths.append([*row, length - used])
        pads.append(length - used)
    tokens = torch.randint(1, vocab_size, (rows, length), generator=gen)
    batch = PackedBatch.from_lengths(tokens, lengths, reset_position_ids=True)
    for r, pad in enumerate(pads):
        batch.tokens[r, -pad:] = 0
        batch.labels[r, -pad:] = IGNORE_INDEX
    return ProbeRows(batch, pads, f"{rows}x{length} synthetic")


def probe_backend(
    backend: str, dtype: str, device: torch.device, length: int, rows: int
) -> Report | str:
    """The report of one (backend, dtype), or why it cannot run here; ``dtype`` is a name in
    longctx.dtypes.DTYPES, the compute dtype (float32: no autocast)."""
    compute = dtype_named(dtype, "--dtypes")
    torch.manual_seed(0)
    config = LlamaConfig.from_name("tiny", attn_backend=backend, max_seq_len=max(length, 8192))
    try:
        model = Llama(config).to(device).eval()
        context = contextlib.nullcontext
        if compute != torch.float32:  # as trainer.precision=bf16-mixed: fp32 weights, autocast
            context = lambda: torch.autocast(device.type, dtype=compute)  # noqa: E731
        target = Target(packed_lm_forward(model), config.vocab_size, True, context=context)
        report = probe(target, [synthetic_rows(length, rows, config.vocab_size).to(device)])
    except (ValueError, RuntimeError, ImportError) as err:
        return f"skipped: {' '.join(str(err).split())[:200]}"
    report.context = {"backend": backend, "dtype": dtype, "device": str(device), "seq_len": length}
    return report


def summary_table(cases: list[tuple[str, str, Report | str]]) -> str:
    header = "| backend | dtype | verdict | isolation (tol) | equivalence (tol) | control |"
    lines = [header, "|---|---|---|---|---|---|"]
    for backend, dtype, report in cases:
        if isinstance(report, str):
            lines.append(f"| {backend} | {dtype} | {report} | | | |")
            continue
        got = {r.check: r for r in report.results}
        iso, eq, ctl = got["isolation/logits"], got["equivalence/logits"], got["positive_control"]
        verdict = "PASS" if report.passed else f"FAIL {report.first_failure.check}"
        lines.append(
            f"| {backend} | {dtype} | {verdict} | {iso.measured:.3g} ({iso.tolerance:.3g}) | "
            f"{eq.measured:.3g} ({eq.tolerance:.3g}) | {ctl.measured:.3g} |"
        )
    return "\n".join(lines)


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longctx.probe.backends")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", default="flash,flex,sdpa,eager")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for backends.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for dtype in args.dtypes.split(","):  # every name checked before any backend runs
        dtype_named(dtype, "--dtypes")
    cases = []
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            report = probe_backend(backend, dtype, device, args.seq_len, args.rows)
            cases.append((backend, dtype, report))
            if not isinstance(report, str):
                print(f"== {backend} {dtype}\n{report.table()}\n{report.summary()}", flush=True)
    print(summary_table(cases), flush=True)
    if args.out:
        path = Path(args.out) / "backends.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = [
            {"backend": b, "dtype": d, **({"skipped": r} if isinstance(r, str) else r.to_dict())}
            for b, d, r in cases
        ]
        atomic_write_text(path, json.dumps(saved, indent=2) + "\n")
        print(f"wrote {path}")
    probed = [r for _, _, r in cases if not isinstance(r, str)]
    return 0 if probed and all(r.passed for r in probed) else 1


if __name__ == "__main__":
    sys.exit(main())
