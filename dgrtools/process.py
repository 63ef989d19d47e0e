"""A consumer in a subprocess (`python -m consumer consumer ...`): for the demo, benchmarks and tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from schemas import WorkerKeys


class ConsumerProcess:
    """Starts a consumer and waits for its first heartbeat; stop() sends SIGTERM, kill() SIGKILL."""

    def __init__(self, redis_url: str, worker_id: str, model: Path | str, log_dir: Path, *,
                 engine: str = "llama", recipe: str = "invariant", slots: int = 8, threads: int = 0,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None, ready_timeout_s: float = 300.0,
                 clock_skew_s: float = 0.0) -> None:
        """`clock_skew_s`: the process's wall clock reads this far off (dgrtools/skewed_clock: a host whose clock
        is wrong)."""
        self.redis_url, self.worker_id = redis_url, worker_id
        self.client = redis.Redis.from_url(redis_url)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"consumer-{worker_id}-{time.monotonic_ns()}.log"
        args = [sys.executable, "-m", "consumer", "consumer", "--redis-url", redis_url, "--worker-id", worker_id,
                "--model", str(model), "--engine", engine, "--recipe", recipe, "--slots", str(slots),
                "--max-batch", str(slots), "--log-format", "text", "--threads", str(threads), *extra]
        started = time.time() + clock_skew_s  # as its clock reads it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if clock_skew_s:
            skewed = str(Path(__file__).parent / "skewed_clock")
            env |= {"DGR_CLOCK_SKEW_S": str(clock_skew_s),
                    "PYTHONPATH": os.pathsep.join(p for p in (skewed, env.get("PYTHONPATH", "")) if p)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            self.wait_heartbeat(since=started, timeout_s=ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def heartbeat(self) -> dict[str, Any] | None:
        raw = self.client.get(WorkerKeys(self.worker_id).heartbeat)
        return json.loads(raw) if raw else None

    def wait_heartbeat(self, since: float, timeout_s: float = 60.0) -> dict[str, Any]:
        """The first heartbeat written after `since` (Unix time)."""
        deadline = time.monotonic() + timeout_s
        while True:
            hb = self.heartbeat()
            if hb is not None and float(hb.get("ts", 0)) >= since:
                return hb
            if self.proc.poll() is not None:
                raise RuntimeError(f"consumer exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat from consumer {self.worker_id!r}:\n{self.log()}")
            time.sleep(0.02)

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # finishes the in-flight fused call, exits 0
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> ConsumerProcess:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
