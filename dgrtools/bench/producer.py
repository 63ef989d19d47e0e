"""`dgr bench producer`: what a Tracker costs and how many sessions one drives, measured from outside.

Each measurement runs a private redis-server and one worker process; this process is only the Tracker.
1. **CPU per token at N and `scale` x N sessions** (default 1,000 and 10,000), sync (`Producer.run_many`) and
   async (`AsyncProducer.run_many`), continuation jobs on: `dgr bench wire`'s run (dgrtools/bench/wire.py: a
   `--engine sleep:<step>` worker, which computes nothing; the CPU of each process from /proc, Redis' `INFO
   cpu` and getrusage, divided by the tokens generated; the Tracker's reads per fused call of the worker). The
   worker takes every prompt in its first prefill calls (`--prefill-ratio 0`, a budget of every prompt), as a
   GPU would: with the sleep engine, prefill calls sized by time would admit a few sessions per call and the
   Tracker would read mostly small records, which is the worker's ramp, not the Tracker's cost.
2. **Sessions at `rate` tokens/s each**: one AsyncProducer, N sessions (`paced`), a step of 1 / rate (one token
   per session per fused call): the tokens/s each session got, and the sessions one Tracker core would drive at
   `rate` with the CPU per token it spent (1 s / (rate x CPU per token)). Every process of the service shares
   this machine's cores, so the worker and Redis limit the rate a session gets too (their CPU is reported).
3. **Inter-token latency as the application sees it**, sync vs async, N sessions on `engine` (a sleep spec,
   or `reference` / `llama` on `model`; every prompt taken at once, as above): the times a token reaches
   `on_result` (both drivers call back after the next jobs are pushed; AsyncProducer in the run_many task).
Figures of a shared machine mean little: run it alone (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import redis
import redis.asyncio as aioredis

from consumer.engines.sleep import parse_sleep_spec
from consumer.runtime import resolve_model
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from producer import AsyncProducer, Producer, SessionHandle
from schemas import RouteHop, Sampling, SessionSpec, StepResult

from . import wire
from .common import console, markdown, save, table

WID = "bench-producer"
Specs = list[tuple[SessionSpec, list[int]]]
CPU_COLUMNS = ("tracker", "sessions", "step ms", "tokens", "tok/s", "e2e / engine-bound", "tracker us/tok",
               "worker us/tok", "redis us/tok", "tracker reads / call")


def _specs(key: Any, vocab: int, n: int, prompt_len: int, tokens: int, tag: str) -> Specs:
    rng = np.random.default_rng(0)
    return [(SessionSpec(session_id=f"{tag}-{i}", account_id="bench", route=(RouteHop(worker_id=WID, key=key),),
                         sampling=Sampling(), max_tokens=tokens),
             [int(t) for t in rng.integers(3, vocab, prompt_len)]) for i in range(n)]


def _cpu_row(r: wire.WireRun) -> tuple[Any, ...]:
    return (r.tracker, r.sessions, r.step_ms, r.tokens, round(r.tok_s), "n/a" if r.ratio is None else round(r.ratio, 3),
            round(r.tracker_us, 1), round(r.worker_us, 1), round(r.redis_us, 1), round(r.reads_per_call, 2))


def _itl(stamps: dict[str, list[float]]) -> dict[str, float]:
    gaps = np.array([b - a for ts in stamps.values() for a, b in itertools.pairwise(ts)]) * 1e3
    return {"itl_p50_ms": float(np.percentile(gaps, 50)), "itl_p99_ms": float(np.percentile(gaps, 99))}


def _itl_sync(url: str, specs: Specs) -> dict[str, float]:
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}

    def on_result(h: SessionHandle, r: StepResult) -> None:
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())

    handles = Producer(redis.Redis.from_url(url), timeout_s=300).run_many(specs, on_result=on_result)
    assert all(h.status == "finished" for h in handles.values()), "a session did not finish"
    return _itl(stamps)


async def _itl_async(url: str, specs: Specs) -> dict[str, float]:
    stamps: dict[str, list[float]] = {s.session_id: [] for s, _ in specs}

    def on_result(h: SessionHandle, r: StepResult) -> None:
        if r.token is not None:
            stamps[r.session_id].append(time.perf_counter())

    client = aioredis.Redis.from_url(url)
    async with AsyncProducer(client, timeout_s=300) as producer:
        handles = await producer.run_many(specs, on_result=on_result)
    await client.aclose()
    assert all(h.status == "finished" for h in handles.values()), "a session did not finish"
    return _itl(stamps)


def inter_token(sessions: int, prompt_len: int, tokens: int, repeats: int, engine: str,
                model: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(appendonly=False) as server:
        consumer = ConsumerProcess(server.url, WID, resolve_model(model), Path(tmp), engine=engine, slots=sessions,
                                   threads=1, extra=_admit_all(sessions, prompt_len))
        try:
            info = Producer(redis.Redis.from_url(server.url)).discover(WID)
            vocab = int(info.info.get("vocab_size", 256))
            for rep, driver in itertools.product(range(repeats), ("sync", "async")):
                specs = _specs(info.keys[0], vocab, sessions, prompt_len, tokens, f"{driver}{rep}")
                itl = _itl_sync(server.url, specs) if driver == "sync" else asyncio.run(_itl_async(server.url, specs))
                rows.append({"driver": driver, "sessions": sessions, **itl})
                console.print(rows[-1])
        finally:
            consumer.stop()
    return rows


def _admit_all(n: int, prompt_len: int = 4) -> list[str]:  # wire.run_one's prompts: 4 tokens
    return ["--prefill-ratio", "0", "--prefill-budget", str(prompt_len * n)]


def run(out_dir: Path, *, sessions: int = 1000, prompt_len: int = 8, tokens: int = 16, repeats: int = 2,
        engine: str = "sleep:20ms", model: str = "tiny", scale: int = 10, rate: float = 50.0,
        paced: Sequence[int] = (250, 1000, 4000), paced_tokens: int = 200, step_ms: float | None = None) -> Path:
    """`step_ms` of the CPU runs: the engine's when it is a sleep spec, else 20 ms."""
    if step_ms is None:
        step_ms = parse_sleep_spec(engine) * 1e3 if engine.startswith("sleep:") else 20.0
    cpu: list[wire.WireRun] = []
    for n, tracker in itertools.product((sessions, sessions * scale), ("sync", "async")):
        cpu.append(wire.run_one(n, step_ms, tokens, use_async=tracker == "async", extra=_admit_all(n)))
        console.print(table("", CPU_COLUMNS, [_cpu_row(cpu[-1])]))
    at_rate: list[wire.WireRun] = []
    for n in paced:
        at_rate.append(wire.run_one(n, 1e3 / rate, paced_tokens, use_async=True, extra=_admit_all(n)))
        console.print(table("", CPU_COLUMNS, [_cpu_row(at_rate[-1])]))
    itl = inter_token(sessions, prompt_len, tokens, repeats, engine, model)

    def med(d: str, k: str) -> float:
        return statistics.median(r[k] for r in itl if r["driver"] == d)

    itl_rows: list[Sequence[Any]] = [(d, sessions, med(d, "itl_p50_ms"), med(d, "itl_p99_ms"))
                                     for d in ("sync", "async")]
    rate_cols = ("sessions", "tok/s per session", "e2e / engine-bound", "tracker us/tok", "tracker cores",
                 f"sessions per tracker core at {rate:g} tok/s", "worker us/tok", "redis us/tok")
    rate_rows = [(r.sessions, round(r.tok_s / r.sessions, 1), round(r.ratio or 0.0, 3), round(r.tracker_us, 1),
                  round(r.tracker_us * r.tok_s / 1e6, 2), int(1e6 / (rate * r.tracker_us)), round(r.worker_us, 1),
                  round(r.redis_us, 1)) for r in at_rate]
    md = "\n\n".join([
        f"Tracker CPU per token (continuation jobs on, a `sleep:{step_ms:g}ms` worker taking every prompt at once):",
        markdown(CPU_COLUMNS, [_cpu_row(r) for r in cpu]),
        f"Sessions at {rate:g} tokens/s each: one AsyncProducer, a `sleep:{1e3 / rate:g}ms` worker (one token per "
        f"session per fused call), {paced_tokens} tokens each; the worker and Redis share the machine:",
        markdown(rate_cols, rate_rows),
        f"Inter-token latency at the callback, {sessions} sessions, `{engine}` (medians of {repeats} runs):",
        markdown(("driver", "sessions", "ITL p50 ms", "ITL p99 ms"), itl_rows)])
    console.print(table(f"producer: {sessions} sessions", ("driver", "sessions", "ITL p50 ms", "ITL p99 ms"),
                        itl_rows))
    return save(out_dir, "producer", {
        "bench": "producer", "sessions": sessions, "scale": scale, "step_ms": step_ms, "tokens": tokens,
        "rate": rate, "engine": engine, "model": model, "repeats": repeats, "cpu": [asdict(r) for r in cpu],
        "paced": [asdict(r) for r in at_rate], "rows": itl, "markdown": md})
