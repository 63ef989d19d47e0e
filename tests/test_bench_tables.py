"""Benchmark tables stay readable at 80 columns (issue 30): every header and value whole, no line wider than the
terminal, whatever the number of columns; a table that fits keeps its rows under its columns."""

from __future__ import annotations

from rich.console import Console

from dgrtools.bench.common import table

COLS = ["model", "recipe", "sessions", "e2e tok/s", "raw tok/s", "e2e / raw", "typical ITL ms", "p99 ITL ms",
        "TTFT p50 ms", "overlap"]
ROWS = [["gemma", "invariant", 8, 169.2, 181.0, 0.933, 5.1, 9.3, 40.0, "on"],
        ["tiny", "fast", 8, 1690.2, 1810.0, 0.931, 0.5, 0.9, 4.0, "off"]]


def _render(cols: list[str], rows: list[list[object]], width: int) -> list[str]:
    c = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    c.print(table("e2e vs raw fused decode", cols, rows, width=width))
    return c.export_text().splitlines()


def test_every_header_is_whole_at_80_columns() -> None:
    wide = (COLS + [f"extra column {i}" for i in range(10)], [r + [1.5] * 10 for r in ROWS * 5])
    for cols, rows in ((COLS, ROWS), wide):
        lines = _render(cols, rows, 80)
        assert max(len(ln) for ln in lines) <= 80
        text = "\n".join(lines)
        assert "…" not in text
        assert all(c in text for c in cols)
        assert all(v in text for v in ("invariant", "0.933", "1.69e+03"))


def test_a_table_that_fits_keeps_its_columns() -> None:
    lines = _render(COLS[:4], [r[:4] for r in ROWS], 80)
    header = next(ln for ln in lines if "model" in ln)
    assert all(c in header for c in COLS[:4])
