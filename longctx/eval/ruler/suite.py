"""One scoring of the suite, written out: what ``python -m longctx.eval ... --suite ruler`` runs.

Scored by generation by default (RULER's way: greedy text, RULER's metric), teacher-forced with
``scoring="teacher_forced"`` (the stricter lower bound; longctx.eval.ruler.scoring). Into
``out``: ``ruler.json`` (the settings, the instances' digest, every table and the effective
lengths) and the tables as CSV (docs/effective-length.md lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from longctx.eval.files import RULER_RESULTS_CSV, RULER_SUMMARY_JSON, write_json, write_rows
from longctx.eval.long_documents import check_eval_length
from longctx.eval.ruler.generate import (
    DEFAULT_DEPTHS,
    NO_QA_DATA,
    check_depth,
    plan_instances,
    resolve_qa,
)  # fmt: skip
from longctx.eval.ruler.instances import RulerInputError, tokens_digest, write_instances
from longctx.eval.ruler.scoring import GENERATE, check_mode, score_instances, summarize
from longctx.synthetic.tasks import TASKS, check_tasks


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
    scoring: str = GENERATE
    # the length the relative effective length is anchored at (a run's training length);
    # None: RULER's effective length only
    anchor: int | None = None
    qa_data: str | None = None  # a folder with RULER's squad.json / hotpotqa.json (qa_1, qa_2)

    def check(self, max_positions: int | None, what: str) -> None:
        """Every refusal before a model is loaded: tasks, depths, lengths within RoPE."""
        named = self.tasks is not None
        self.tasks = check_tasks(self.tasks, "suite")
        if self.qa_data is not None:
            resolve_qa(self.qa_data)  # a folder in the wrong form: one line, before any model
        else:
            asked_qa = [t for t in self.tasks if TASKS[t].reads == "qa"]
            if named and asked_qa:
                raise RulerInputError(
                    f"{', '.join(asked_qa)} need --qa-data DIR ({NO_QA_DATA}); pass it or drop them"
                )
        self.depths = [check_depth(d) for d in self.depths]
        check_mode(self.scoring)
        self.check_lengths(max_positions, what)

    def check_lengths(self, max_positions: int | None, what: str) -> None:
        """The lengths, within ``max_positions`` (a model's, once known; the tasks were checked
        by :meth:`check`, which runs once: a second run would take its full task list for
        tasks the user named)."""
        if not self.lengths:
            raise RulerInputError("--lengths is empty; expected context lengths in tokens")
        for n in self.lengths:
            if max_positions is not None:
                check_eval_length(n, max_positions, what)


def run_suite(model, tokenizer, settings: SuiteSettings, out: Path, device="cpu", cache_dir=None):
    """Generate, score, summarise and write; returns the summary (also ``out/ruler.json``)."""
    s = settings
    plan = plan_instances(
        tokenizer, s.tasks, s.lengths, s.depths, s.samples, s.seed, s.haystack, cache_dir,
        qa_data=s.qa_data,
    )  # fmt: skip
    print(plan.describe())  # which tasks ran, which were skipped (a length too short, no data)
    instances = plan.instances
    results = score_instances(
        model, instances, s.batch_size, device, scoring=s.scoring, tokenizer=tokenizer
    )
    report = summarize(results, s.anchor)
    summary = {
        "settings": {**dataclasses.asdict(s), "instance_seed": s.seed},
        "instances": len(instances),
        "instances_sha256": tokens_digest(instances),
        "ran": list(dict.fromkeys(i.task for i in instances)),
        "skipped": plan.skipped,
        **report,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_rows(results, out / RULER_RESULTS_CSV)
    for name in ("cells", "lengths", "suite", "copy_curve"):
        if report[name]:
            write_rows(report[name], out / f"ruler_{name}.csv")
    if s.write_instances:
        write_instances(instances, tokenizer, out / "ruler_instances.jsonl")
    write_json(summary, out / RULER_SUMMARY_JSON)
    print(format_summary(summary))
    print(f"in {out}")
    return summary


def format_summary(summary: dict) -> str:
    """Score per task and length (over depths) as a Markdown table, then the effective lengths."""
    lengths = [r["length"] for r in summary["suite"]]
    lines = ["| task | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---|" * len(lengths)]
    for name in dict.fromkeys(r["task"] for r in summary["lengths"]):
        cells = {r["length"]: r for r in summary["lengths"] if r["task"] == name}
        lines.append(f"| {name} | " + " | ".join(_cell(cells.get(n)) for n in lengths) + " |")
    lines.append("| mean | " + " | ".join(f"{r['score']:.2f}" for r in summary["suite"]) + " |")
    scoring = ", ".join(summary["scoring"])
    lines += ["", f"scoring: {scoring}" + (_LOWER_BOUND if scoring == "teacher_forced" else "")]
    return "\n".join(lines + effective_length_lines(summary["effective_length"]))


_LOWER_BOUND = " (every answer token the argmax: a stricter lower bound of RULER's metric)"


def effective_length_lines(found: dict) -> list[str]:
    """RULER's effective length and, beside it, the relative one, with their 95% intervals."""
    lines = []
    for key in ("ruler", "relative"):
        if found.get(key) is None:
            continue
        value = found[key]["length"] or "none (below the threshold at every length)"
        low, high = (v or "none" for v in found[key]["ci"])
        name = {"ruler": "RULER's", "relative": "relative"}[key]
        lines.append(f"{name} effective length {value} [{low}, {high}]: {found[key]['rule']}")
    return lines or [
        "effective length: none computed (no RULER task scored, no training length to anchor "
        "the relative rule)"
    ]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['score']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"
