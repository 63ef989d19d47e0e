"""What each part may load and know: the layering docs/architecture.md states, checked in a fresh
interpreter (what importing a part loads) and in the sources (what a part names)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICE_MODULE_MAX_LINES = 450  # docs/architecture.md: a module is read in one sitting
LONGER_ALLOWED = {"consumer/engines/llama.py"}  # the engine's one llama.cpp binding (issue 21 names it)


def _modules_after(stmt: str) -> set[str]:
    code = f"import json, sys\n{stmt}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _names(path: Path) -> set[str]:
    """Every name a module imports or refers to (import targets, attribute and plain names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
    return out


def test_importing_the_scheduler_loads_no_engine_nor_io() -> None:
    loaded = _modules_after("import consumer.sched, consumer.sampler")
    assert not {m for m in loaded if m.startswith("consumer.engines")}, "the scheduler must not load an engine"
    for forbidden in ("redis", "llama_cpp", "consumer.transport", "consumer.worker"):
        assert forbidden not in loaded, f"the scheduler loaded {forbidden}"


def test_the_worker_loop_imports_nothing_of_redis() -> None:
    loaded = _modules_after("import consumer.worker")
    assert "redis" not in loaded and not any(m.startswith("redis.") for m in loaded), "the worker loaded redis"
    assert not {m for m in loaded if m.startswith("consumer.transport.") and m.split(".")[-1]
                not in ("protocol", "errors")}, "the worker loaded the Redis transport"
    for path in _sources("consumer/worker"):
        names = _names(path)
        assert not names & {"redis", "RedisTransport", "WorkerKeys", "GROUP"}, f"{path}: speaks Redis"


def test_the_scheduler_builds_no_wire_model() -> None:
    wire = {"StepResult", "Accounting", "ResultRecord", "Charges", "job_to_fields", "job_from_fields",
            "results_from_fields", "results_to_fields", "schemas.wire"}
    for path in _sources("consumer/sched"):
        assert not _names(path) & wire, f"{path}: the scheduler names a wire model: {_names(path) & wire}"


def test_no_stream_id_outside_the_transport() -> None:
    """Entry ids are the transport's: the worker, scheduler, engines and ops never spell one."""
    for path in _sources("consumer"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("consumer/transport/") or rel.startswith("consumer/ops/"):
            continue
        text = path.read_text(encoding="utf-8")
        assert '"0-0"' not in text and "'0-0'" not in text, f"{rel}: a stream id outside the transport"


def test_service_modules_are_read_in_one_sitting() -> None:
    long = {}
    for package in ("consumer", "schemas", "producer"):
        for path in _sources(package):
            rel = path.relative_to(ROOT).as_posix()
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > SERVICE_MODULE_MAX_LINES and rel not in LONGER_ALLOWED:
                long[rel] = n
    assert not long, f"modules over {SERVICE_MODULE_MAX_LINES} lines: {long}"
