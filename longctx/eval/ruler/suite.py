"""One scoring of the suite, written out: what ``python -m longctx.eval ... --suite ruler`` runs.

Into ``out``: ``ruler.json`` (the settings, the instances' digest, every table and the effective
length with its rule), ``ruler_results.csv`` (one row per instance), ``ruler_cells.csv`` (task x
length x depth with 95% CIs), ``ruler_lengths.csv``, ``ruler_suite.csv``, ``ruler_copy_curve.csv``
and, when asked, ``ruler_instances.jsonl`` (each instance's text and answer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from longctx.eval.files import write_json, write_rows
from longctx.eval.long_documents import check_eval_length
from longctx.eval.ruler.generate import DEFAULT_DEPTHS, check_depth, check_tasks, make_instances
from longctx.eval.ruler.instances import RulerInputError, tokens_digest, write_instances
from longctx.eval.ruler.scoring import score_instances, summarize


@dataclasses.dataclass
class SuiteSettings:
    tasks: Sequence[str] | str | None = None
    lengths: Sequence[int] = (1024, 2048, 4096)
    depths: Sequence[float] = DEFAULT_DEPTHS
    samples: int = 4
    seed: int = 0
    haystack: str = "books"
    batch_size: int = 4
    write_instances: bool = False

    def check(self, max_positions: int | None, what: str) -> None:
        """Every refusal before a model is loaded: tasks, depths, lengths within RoPE."""
        self.tasks = check_tasks(self.tasks)
        self.depths = [check_depth(d) for d in self.depths]
        if not self.lengths:
            raise RulerInputError("--lengths is empty; expected context lengths in tokens")
        for n in self.lengths:
            if max_positions is not None:
                check_eval_length(n, max_positions, what)


def run_suite(model, tokenizer, settings: SuiteSettings, out: Path, device="cpu", cache_dir=None):
    """Generate, score, summarise and write; returns the summary (also ``out/ruler.json``)."""
    s = settings
    instances = make_instances(
        tokenizer, s.tasks, s.lengths, s.depths, s.samples, s.seed, s.haystack, cache_dir
    )
    results = score_instances(model, instances, s.batch_size, device)
    report = summarize(results)
    summary = {
        "settings": {**dataclasses.asdict(s), "instance_seed": s.seed},
        "instances": len(instances),
        "instances_sha256": tokens_digest(instances),
        **report,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_rows(results, out / "ruler_results.csv")
    for name in ("cells", "lengths", "suite", "copy_curve"):
        if report[name]:
            write_rows(report[name], out / f"ruler_{name}.csv")
    if s.write_instances:
        write_instances(instances, tokenizer, out / "ruler_instances.jsonl")
    write_json(summary, out / "ruler.json")
    print(format_summary(summary))
    print(f"in {out}")
    return summary


def format_summary(summary: dict) -> str:
    """Accuracy per task and length (over depths) as a Markdown table, then the effective length."""
    lengths = [r["length"] for r in summary["suite"]]
    lines = ["| task | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
    for name in dict.fromkeys(r["task"] for r in summary["lengths"]):
        cells = {r["length"]: r for r in summary["lengths"] if r["task"] == name}
        lines.append(f"| {name} | " + " | ".join(_acc(cells[n]) for n in lengths) + " |")
    lines.append("| mean | " + " | ".join(f"{r['accuracy']:.2f}" for r in summary["suite"]) + " |")
    rule = summary["effective_length_rule"]
    value = summary["effective_length"] or "none (below the threshold at every length)"
    return "\n".join(lines) + f"\n\neffective length {value}: {rule['rule']}"


def _acc(row: dict) -> str:
    return f"{row['accuracy']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"
