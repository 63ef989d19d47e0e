"""How llama.cpp's CPU threads wait for each other: spin or sleep (issue 25, docs/operations.md).

ggml's CPU threads meet at a barrier after every op of the graph. This llama-cpp-python build runs them
with OpenMP (`OPENMP = 1` in `llama_print_system_info`), whose threads *spin* at a barrier by default
(libgomp spins a while before it sleeps): fastest on cores of its own, but a thread that loses its core
to another busy process stalls the others for a scheduler slice. With `OMP_WAIT_POLICY=PASSIVE` they
sleep at once. Measured with Gemma 3 270M (`dgr demo`, 8 sessions x 64 tokens, 2 cores, threads = 2):

| beside | spin (default) | sleep (PASSIVE) |
| --- | --- | --- |
| nothing | 121-140 tok/s | 109-125 tok/s |
| one busy llama.cpp process (tiny model, 2 threads) | 68 (2.0x slower) | 82 (1.3x) |
| two busy llama.cpp processes | 37 (3.3x) | 61 (1.9x) |
| two busy Python loops | 78 (1.8x) | 57 (2.2x) |

So: spin on a machine of its own, sleep beside other llama.cpp-style spinners. `auto` (the default) looks
at the machine for a quarter of a second when the engine starts (/proc/stat): sleep when other processes
keep at least half a core busy, else spin; the engine's `describe()` says which and why. (Not the load
average: it remembers the last minute, and after a build or a benchmark it chose sleep on an idle
machine.)
The choice is read by libgomp when llama.cpp's libraries load, so it is made before the first import of
llama_cpp; an `OMP_WAIT_POLICY` already in the environment wins (and is reported).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Final

__all__ = ["CPU_WAITS", "apply_cpu_wait", "choose_cpu_wait"]

CPU_WAITS: Final = ("auto", "spin", "sleep")


def _cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of the machine, from /proc/stat's first line (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0.0)  # idle + iowait
    total = sum(v[:8])  # guest time is counted in user already
    return total - idle, total


def busy_elsewhere(window_s: float = 0.25) -> float | None:
    """Cores kept busy by other processes right now: the machine's busy share over a short window while
    this process sleeps, times its cores (None when /proc/stat cannot be read)."""
    a = _cpu_times()
    time.sleep(window_s)
    b = _cpu_times()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def choose_cpu_wait(setting: str, busy: float | None) -> tuple[str, str]:
    """('spin' | 'sleep', why) for a setting of CPU_WAITS; `busy`: cores other processes keep busy."""
    if setting not in CPU_WAITS:
        raise ValueError(f"cpu wait must be one of {', '.join(CPU_WAITS)}, not {setting!r}")
    if setting != "auto":
        return setting, "asked"
    if busy is None:
        return "spin", "auto: /proc/stat unreadable"
    return ("sleep" if busy >= 0.5 else "spin"), f"auto: {busy:.2f} cores busy elsewhere at start"


def apply_cpu_wait(setting: str) -> str:
    """Set OMP_WAIT_POLICY for llama.cpp's threads (before its libraries load); what happened, in words."""
    env = os.environ.get("OMP_WAIT_POLICY")
    if env:
        return f"{env.strip().lower()} (OMP_WAIT_POLICY={env} in the environment)"
    if setting not in CPU_WAITS:
        raise ValueError(f"cpu wait must be one of {', '.join(CPU_WAITS)}, not {setting!r}")
    mode, why = choose_cpu_wait(setting, busy_elsewhere() if setting == "auto" else None)
    if mode == "spin":
        return f"spin (OpenMP's default wait, {why})"
    if "llama_cpp" in sys.modules:
        return f"spin (llama.cpp was loaded before the engine could choose; wanted sleep, {why})"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return f"sleep (OMP_WAIT_POLICY=PASSIVE, {why})"
