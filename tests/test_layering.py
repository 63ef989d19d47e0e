"""What each part may load: the layering docs/architecture.md states, checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys


def _modules_after(stmt: str) -> set[str]:
    code = f"import json, sys\n{stmt}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def test_importing_the_scheduler_loads_no_engine_nor_io() -> None:
    loaded = _modules_after("import consumer.sched.scheduler, consumer.sampler")
    assert not {m for m in loaded if m.startswith("consumer.engines")}, "the scheduler must not load an engine"
    for forbidden in ("redis", "llama_cpp", "consumer.transport", "consumer.worker"):
        assert forbidden not in loaded, f"the scheduler loaded {forbidden}"
