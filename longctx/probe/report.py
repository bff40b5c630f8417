"""The probe's result table (check x measured value x tolerance x verdict) and its JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from longctx.io import atomic_write_text


@dataclasses.dataclass
class Result:
    """One check on one batch of rows. ``measured`` and ``tolerance`` are counts (static checks)
    or relative differences (max |difference| / max |reference output|); ``verdict`` is pass,
    fail, or info (a measurement other checks build on); ``where`` names the first failure."""

    check: str
    rows: str
    measured: float | int
    tolerance: float | int | None
    verdict: str
    where: str = ""
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


@dataclasses.dataclass
class Report:
    results: list[Result]
    context: dict = dataclasses.field(default_factory=dict)  # what was probed: model, layout

    @property
    def passed(self) -> bool:
        return not any(r.failed for r in self.results)

    @property
    def first_failure(self) -> Result | None:
        return next((r for r in self.results if r.failed), None)

    def summary(self) -> str:
        """One line: PASS, or the first failing check with its row and document."""
        failure = self.first_failure
        if failure is None:
            return f"leak probe: PASS ({len(self.results)} results, none failed)"
        value = f"{_number(failure.measured)} > {_number(failure.tolerance)}"
        if failure.check == "positive_control":
            value = f"{_number(failure.measured)} <= {_number(failure.tolerance)}"
        return f"leak probe: FAIL {failure.check} [{failure.rows}] {failure.where} ({value})"

    def table(self) -> str:
        header = ("check", "rows", "measured", "tolerance", "verdict")
        lines = [
            (r.check, r.rows, _number(r.measured), _number(r.tolerance), r.verdict)
            for r in self.results
        ]
        widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([_cells(header, widths), rule, *(_cells(x, widths) for x in lines)])

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "first_failure": dataclasses.asdict(f) if (f := self.first_failure) else None,
            "context": self.context,
            "results": [dataclasses.asdict(r) for r in self.results],
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _cells(cells: tuple[str, ...], widths: list[int]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if value else "0"
