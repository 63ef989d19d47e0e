"""`dgr bench producer`: the Tracker's cost, AsyncProducer vs the synchronous Producer, many sessions at once.

One consumer (a subprocess, the tiny model) and a private redis-server; this process is only the producer.
The same N sessions (prompt of `prompt_len` tokens, `tokens` generated each, all opened at once) are driven
alternately, `repeats` times each, by:
- sync: `Producer.run_many` (one thread, one XREAD per loop over all sessions);
- async: one `AsyncProducer`, one asyncio task per session doing `async for token in producer.generate(...)`.

Measured per run: the producer's CPU time (this process's `time.process_time()`, so the consumer's CPU is not
in it) per step (one step = one result the producer handled: a prefill chunk or a decode token), the wall
time, and the time between a session's tokens as the application sees them (sync: `on_result`; async: the
token coming out of `generate`), p50 and p99 over all sessions. "Added latency" is the async figure minus the
sync one, same run. Both drivers share the machine with the consumer (2 cores here): the inter-token times
are mostly the worker's fused calls; the difference between the drivers is the point.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from consumer.runtime import resolve_model
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from producer import Producer, SessionHandle
from producer.aio import AsyncProducer
from schemas import RouteHop, Sampling, SessionSpec, StepResult

from .common import console, markdown, save, table

WID = "bench-producer"
Specs = list[tuple[SessionSpec, list[int]]]


def _specs(key: Any, vocab: int, n: int, prompt_len: int, tokens: int, tag: str) -> Specs:
    rng = np.random.default_rng(0)
    return [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(RouteHop(worker_id=WID, key=key),),
                         sampling=Sampling(), max_tokens=tokens),
             [int(t) for t in rng.integers(3, vocab, prompt_len)]) for i in range(n)]


def _gaps(stamps: dict[str, list[float]]) -> list[float]:
    return [b - a for ts in stamps.values() for a, b in itertools.pairwise(ts)]


def _summary(driver: str, specs: Specs, steps: int, tokens: int, cpu_s: float, wall_s: float,
             stamps: dict[str, list[float]]) -> dict[str, Any]:
    gaps = np.array(_gaps(stamps)) * 1e3
    return {"driver": driver, "sessions": len(specs), "steps": steps, "tokens": tokens, "wall_s": wall_s,
            "cpu_s": cpu_s, "cpu_us_per_step": cpu_s / steps * 1e6, "tok_s": tokens / wall_s,
            "itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99))}


def run_sync(url: str, specs: Specs) -> dict[str, Any]:
    producer = Producer(redis.Redis.from_url(url), timeout_s=300)
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}
    steps = 0

    def on_result(h: SessionHandle, r: StepResult) -> None:
        nonlocal steps
        steps += 1
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())

    cpu0, t0 = time.process_time(), time.perf_counter()
    handles = producer.run_many(specs, on_result=on_result)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    assert all(h.status == "finished" for h in handles.values()), "a session did not finish"
    return _summary("sync", specs, steps, sum(len(h.generated) for h in handles.values()), cpu, wall, stamps)


async def _drive_async(url: str, specs: Specs) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}
    async with AsyncProducer(client, timeout_s=300) as producer:
        async def one(spec: SessionSpec, prompt: list[int]) -> int:
            n = 0
            async for _token in producer.generate(spec, prompt):
                stamps[spec.session_id].append(time.perf_counter())
                n += 1
            return n

        cpu0, t0 = time.process_time(), time.perf_counter()
        counts = await asyncio.gather(*(one(s, p) for s, p in specs))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    await client.aclose()
    # the steps the producer handled: every prefill chunk's result and every decode step's
    chunk = producer.prefill_chunk
    steps = sum(-(-len(p) // chunk) - 1 + n for (_, p), n in zip(specs, counts, strict=True))
    return _summary("async", specs, steps, sum(counts), cpu, wall, stamps)


def run(out_dir: Path, *, sessions: int = 1000, prompt_len: int = 8, tokens: int = 16, repeats: int = 2,
        engine: str = "reference", model: str = "tiny") -> Path:
    path = resolve_model(model)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(appendonly=False) as server:
        consumer = ConsumerProcess(server.url, WID, path, Path(tmp), engine=engine, slots=sessions, threads=1)
        try:
            info = Producer(redis.Redis.from_url(server.url)).discover(WID)
            vocab = int(info.info.get("vocab_size", 256))
            for rep in range(repeats):
                for driver in ("sync", "async"):
                    specs = _specs(info.keys[0], vocab, sessions, prompt_len, tokens, f"{driver}{rep}")
                    row = run_sync(server.url, specs) if driver == "sync" else asyncio.run(
                        _drive_async(server.url, specs))
                    console.print(row)
                    rows.append(row)
        finally:
            consumer.stop()
    by = {d: [r for r in rows if r["driver"] == d] for d in ("sync", "async")}

    def med(d: str, k: str) -> float:
        return statistics.median(r[k] for r in by[d])

    cols = ["driver", "sessions", "steps", "tok/s", "producer CPU us/step", "ITL p50 ms", "ITL p99 ms"]
    table_rows: list[Sequence[Any]] = [
        (d, sessions, int(med(d, "steps")), med(d, "tok_s"), med(d, "cpu_us_per_step"), med(d, "itl_p50_ms"),
         med(d, "itl_p99_ms")) for d in ("sync", "async")]
    added = {"itl_p50_ms": med("async", "itl_p50_ms") - med("sync", "itl_p50_ms"),
             "itl_p99_ms": med("async", "itl_p99_ms") - med("sync", "itl_p99_ms"),
             "cpu_ratio": med("async", "cpu_us_per_step") / med("sync", "cpu_us_per_step")}
    md = markdown(cols, table_rows) + (
        f"\n\nMedians of {repeats} runs each, alternating. Async vs sync: producer CPU per step "
        f"x{added['cpu_ratio']:.2f}; added inter-token latency p50 {added['itl_p50_ms']:+.2f} ms, "
        f"p99 {added['itl_p99_ms']:+.2f} ms.")
    console.print(table(f"producer: {sessions} sessions, {engine} engine, {model}", cols, table_rows))
    return save(out_dir, "producer", {"bench": "producer", "sessions": sessions, "prompt_len": prompt_len,
                                      "tokens": tokens, "repeats": repeats, "engine": engine, "model": model,
                                      "rows": rows, "added": added, "markdown": md})
