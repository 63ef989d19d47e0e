"""How llama.cpp's CPU threads wait (consumer/engines/cpu_wait.py): the choice, and that it reaches the
engine's description in a fresh process (OpenMP reads it when llama.cpp's libraries load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from consumer.engines.cpu_wait import choose_cpu_wait


def test_auto_sleeps_when_other_processes_keep_a_core_busy() -> None:
    assert choose_cpu_wait("auto", 0.1)[0] == "spin"
    assert choose_cpu_wait("auto", 0.5)[0] == "sleep" and choose_cpu_wait("auto", 1.9)[0] == "sleep"
    assert choose_cpu_wait("auto", None) == ("spin", "auto: /proc/stat unreadable")
    assert choose_cpu_wait("sleep", 0.0) == ("sleep", "asked") and choose_cpu_wait("spin", 2.0)[0] == "spin"
    with pytest.raises(ValueError):
        choose_cpu_wait("fast", 0.0)


def test_a_busy_process_is_seen_and_an_idle_machine_is_not() -> None:
    """busy_elsewhere() over its window: a Python loop in another process keeps about one core busy."""
    from consumer.engines.cpu_wait import busy_elsewhere

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        busy = busy_elsewhere(0.5)
    finally:
        hog.kill()
        hog.wait()
    assert busy is not None and busy >= 0.5  # the loop (at least), whatever else runs beside this test


_PROBE = """
import json, sys
from consumer.engines.llama import LlamaCppEngine
e = LlamaCppEngine(sys.argv[1], n_slots=1, ctx_per_session=64, cpu_wait=sys.argv[2])
import os
print(json.dumps({"cpu_wait": e.describe()["cpu_wait"], "env": os.environ.get("OMP_WAIT_POLICY")}))
"""


@pytest.mark.parametrize(("setting", "env", "says"), [
    ("sleep", None, "sleep (OMP_WAIT_POLICY=PASSIVE, asked)"),
    ("spin", None, "spin (OpenMP's default wait, asked)"),
    ("sleep", "ACTIVE", "active (OMP_WAIT_POLICY=ACTIVE in the environment)"),
])
def test_the_engine_sets_and_says_its_wait_before_llama_cpp_loads(tiny_model_path: Path, setting: str,
                                                                  env: str | None, says: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env:
        environ["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tiny_model_path), setting], capture_output=True,
                         text=True, env=environ, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cpu_wait"] == says
    assert got["env"] == ("PASSIVE" if setting == "sleep" and env is None else env)
