"""The service runs without the tools: `dgr consumer` loads no benchmark, no tool, no matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys

# What `dgr consumer` imports to run a model file it is given (consumer/cli.py's consumer command).
SERVICE = ("consumer.cli", "consumer.worker", "consumer.transport", "consumer.runtime", "consumer.metrics",
           "consumer.logs", "consumer.engines.llama", "consumer.engines.reference")


def test_the_consumer_command_imports_no_tooling() -> None:
    code = (f"import importlib, json, sys\nfor m in {SERVICE!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                           text=True).stdout))
    bad = sorted(m for m in loaded if m.split(".")[0] in {"matplotlib", "bench", "dgrtools", "tests"})
    assert bad == []
