"""What every benchmark shares: where results go, the machine they ran on, tables and plots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from consumer.cpuinfo import cpu_field

console = Console()


def machine() -> dict[str, Any]:
    cpu = cpu_field("model name")
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else 0
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem, 1), "python": platform.python_version(),
            "platform": platform.platform(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _cell(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _width(columns: Sequence[str], cells: Sequence[Sequence[str]]) -> int:
    """The width rich draws a table of these cells in, with no column squashed (borders and padding: 3 a column)."""
    return 1 + sum(3 + max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns))


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], width: int | None = None) -> Table:
    """The rows under their columns when that fits the terminal (`width`: the console's); else turned on their
    side, one column per row, headers down the left; else one section per row of `column  value` lines. Never a
    header squashed to "e2e…" (80 columns, issue 30)."""
    width = console.width if width is None else width
    cells = [[_cell(v) for v in r] for r in rows]
    if _width(columns, cells) <= width:
        t = Table(title=title)
        for c in columns:
            t.add_column(c, justify="right")
        for r in cells:
            t.add_row(*r)
        return t
    sideways = [list(x) for x in zip(*cells, strict=True)] if cells else [[] for _ in columns]
    head = [""] + [f"#{i + 1}" for i in range(len(cells))]
    if _width(head, [[c, *v] for c, v in zip(columns, sideways, strict=True)]) <= width:
        t = Table(title=title)
        t.add_column("", justify="left")
        for h in head[1:]:
            t.add_column(h, justify="right")
        for c, values in zip(columns, sideways, strict=True):
            t.add_row(c, *values)
        return t
    t = Table(title=title, show_header=False)
    t.add_column("", justify="left", overflow="fold")
    t.add_column("", justify="right", overflow="fold")
    for i, r in enumerate(cells):
        if i:
            t.add_section()
        for c, v in zip(columns, r, strict=True):
            t.add_row(c, v)
    return t


def markdown(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cell = _cell
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def save(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=1, default=str))
    return path


def plot(out_dir: Path, name: str, title: str, xlabel: str, ylabel: str,
         series: dict[str, tuple[Sequence[float], Sequence[float]]], logx: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out_dir, name)


def save_figure(fig: Any, out_dir: Path, name: str) -> Path:
    """Write a matplotlib figure as out_dir/name.png and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
