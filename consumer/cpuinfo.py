"""/proc/cpuinfo, read in one place (the engine's AMX check, the benchmarks' machine line, the peer build)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["cpu_field", "cpu_flags"]


def _text() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_field(name: str, cpuinfo: str | None = None) -> str:
    """The value of the first CPU's `name` line ("" when absent or unreadable)."""
    for line in (_text() if cpuinfo is None else cpuinfo).splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The `flags` of the first CPU (empty when unreadable)."""
    return set(cpu_field("flags", cpuinfo).split())
