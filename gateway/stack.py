"""A started `dgr serve` in a subprocess, waited on until /health answers: for the tests and `dgr bench serve`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx


class ServeProcess:
    def __init__(self, redis_url: str, models: Sequence[str], port: int, log_dir: Path, *,
                 extra: Sequence[str] = (), env: dict[str, str] | None = None, ready_timeout_s: float = 60.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"serve-{port}-{time.monotonic_ns()}.log"
        args = [sys.executable, "-m", "consumer", "serve", "--redis-url", redis_url, "--port", str(port),
                *(a for m in models for a in ("--model", m)), *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        deadline = time.monotonic() + ready_timeout_s
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"dgr serve did not start:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
