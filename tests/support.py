"""Helpers for the end-to-end tests: a consumer in a subprocess, solo reference runs, prompts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import redis

from consumer.batch import BatchRow, FusedBatch
from consumer.engines.base import Engine
from schemas import WorkerKeys

ROOT = Path(__file__).resolve().parents[1]


class ConsumerProcess:
    """`python -m consumer consumer ...` with its log in a file; stop() by SIGTERM, kill() by SIGKILL."""

    def __init__(self, redis_url: str, worker_id: str, model: Path, log_dir: Path, *, engine: str = "reference",
                 recipe: str = "invariant", slots: int = 8, extra: Sequence[str] = ()) -> None:
        self.redis_url, self.worker_id = redis_url, worker_id
        self.log_path = log_dir / f"consumer-{worker_id}-{time.monotonic_ns()}.log"
        args = [sys.executable, "-m", "consumer", "consumer", "--redis-url", redis_url, "--worker-id", worker_id,
                "--model", str(model), "--engine", engine, "--recipe", recipe, "--slots", str(slots),
                "--max-batch", str(slots), "--log-format", "text", "--threads", "2", *extra]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        client = redis.Redis.from_url(self.redis_url)
        keys = WorkerKeys(self.worker_id)
        deadline = time.monotonic() + timeout_s
        start = time.time()
        while True:
            hb = client.get(keys.heartbeat)
            if hb is not None and self._fresh(hb, start):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"consumer exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumer not ready:\n{self.log()}")
            time.sleep(0.05)

    @staticmethod
    def _fresh(hb: bytes, since: float) -> bool:
        import json

        try:
            data = json.loads(hb)
        except ValueError:
            return True
        ts = data.get("ts") or data.get("time") or data.get("at") if isinstance(data, dict) else None
        return ts is None or float(ts) >= since - 1.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, int(rng.integers(lo, hi + 1)))] for _ in range(n)]


def solo_generate(engine: Engine, prompt: Sequence[int], max_tokens: int, slot: int = 0,
                  chunk: int = 512) -> list[int]:
    """Greedy generation of one session alone, straight on the engine (no Redis, no scheduler)."""
    engine.release(slot)
    logits = None
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        last = start + len(part) == len(prompt)
        rows = [BatchRow(slot, start + i, t, last and i == len(part) - 1) for i, t in enumerate(part)]
        out = engine.step(FusedBatch.from_rows("prefill", rows))
        if last:
            logits = out[0]
    assert logits is not None
    tokens = [int(np.argmax(logits))]
    pos = len(prompt)
    while len(tokens) < max_tokens:
        out = engine.step(FusedBatch.from_rows("decode", [BatchRow(slot, pos, tokens[-1], True)]))
        pos += 1
        tokens.append(int(np.argmax(out[0])))
    engine.release(slot)
    return tokens
