"""No function over 60 lines in the worker, transport and scheduler packages (issue 30: each readable at once;
DEVELOPERS.md's ~60). Counted from `def` to the function's last line, docstring and comments included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("consumer/worker", "consumer/transport", "consumer/sched")
LIMIT = 60


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (n.end_lineno or n.lineno) - n.lineno + 1
            if lines > limit:
                out.append((n.name, lines))
    return out


def test_the_count_sees_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    assert long_functions(f"def f():\n{body}\n") == [("f", LIMIT + 1)]
    assert long_functions("def g():\n    return 1\n") == []


def test_no_function_over_60_lines() -> None:
    found = [f"{f.relative_to(ROOT)}: {name} ({n} lines)" for pkg in PACKAGES
             for f in sorted((ROOT / pkg).rglob("*.py")) for name, n in long_functions(f.read_text())]
    assert found == []
