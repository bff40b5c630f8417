"""No function in longctx/ or studies/ is longer than MAX_LINES lines, from its ``def`` line to its last,
docstring and comments included: a longer one holds more than one step and is split."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

MAX_LINES = 60


def long_functions(package: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function and method over ``limit`` lines."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    where = path.relative_to(package.parent)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_longctx_or_studies_is_over_the_limit():
    found = long_functions(ROOT / "longctx") + long_functions(ROOT / "studies")
    assert not found, f"functions over {MAX_LINES} lines:\n" + "\n".join(found)


def test_the_check_counts_from_def_to_the_last_line(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (package / "m.py").write_text(
        f'def short():\n{body}\n\n\ndef long():\n    """Doc."""\n{body}\n'
    )
    assert long_functions(package) == ["pkg/m.py:63 long (61 lines)"]
