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

So: spin on a machine of its own, sleep beside other llama.cpp-style spinners. `auto` (the default) picks
at start from the machine's load: sleep when the 1-minute load average is at least half the cores this
process may use (something else is busy here), else spin; the engine's `describe()` says which and why.
The choice is read by libgomp when llama.cpp's libraries load, so it is made before the first import of
llama_cpp; an `OMP_WAIT_POLICY` already in the environment wins (and is reported).
"""

from __future__ import annotations

import os
import sys
from typing import Final

__all__ = ["CPU_WAITS", "apply_cpu_wait", "choose_cpu_wait"]

CPU_WAITS: Final = ("auto", "spin", "sleep")


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def choose_cpu_wait(setting: str, cores: int, load: float | None) -> tuple[str, str]:
    """('spin' | 'sleep', why) for a setting of CPU_WAITS."""
    if setting not in CPU_WAITS:
        raise ValueError(f"cpu wait must be one of {', '.join(CPU_WAITS)}, not {setting!r}")
    if setting != "auto":
        return setting, "asked"
    if load is None:
        return "spin", "auto: no load average here"
    busy = load >= 0.5 * cores
    return ("sleep" if busy else "spin"), f"auto: load {load:.2f} on {cores} cores at start"


def apply_cpu_wait(setting: str) -> str:
    """Set OMP_WAIT_POLICY for llama.cpp's threads (before its libraries load); what happened, in words."""
    env = os.environ.get("OMP_WAIT_POLICY")
    if env:
        return f"{env.strip().lower()} (OMP_WAIT_POLICY={env} in the environment)"
    mode, why = choose_cpu_wait(setting, _cores(), _load())
    if mode == "spin":
        return f"spin (OpenMP's default wait, {why})"
    if "llama_cpp" in sys.modules:
        return f"spin (llama.cpp was loaded before the engine could choose; wanted sleep, {why})"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return f"sleep (OMP_WAIT_POLICY=PASSIVE, {why})"
