"""Push before you call back (issue 22): a slow `on_result` callback (a Tracker that writes each token to its own
clients) must not slow the worker. Both drivers push every session's next jobs before any callback of a read runs
(AsyncProducer runs them in the run_many task, never in its pump), so with continuation jobs the worker keeps its
credit and decodes call after call. Measured on the worker's side: the gaps between its fused decode calls, with a
real worker (the sleep engine: a fixed time per call) in a thread, on a real redis-server."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import redis
import redis.asyncio as aioredis

from consumer.batch import FusedBatch
from consumer.engines.sleep import SleepEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from dgrtools.localredis import LocalRedis
from producer import AsyncProducer, Producer, SessionHandle
from schemas import RouteHop, SessionSpec, StepResult

STEP_S = 0.004
SESSIONS = 8
TOKENS = 160
SLOW_S = 0.06  # a callback's sleep per read: 15 of the worker's fused calls, under the 16 of one job's credit


class TimedSleep(SleepEngine):
    """The sleep engine, noting when each fused decode call starts and ends."""

    def __init__(self) -> None:
        super().__init__(STEP_S, n_slots=SESSIONS)
        self.decode: list[tuple[float, float]] = []

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        t0 = time.perf_counter()
        out = super().step(batch)
        if batch.phase == "decode":
            self.decode.append((t0, time.perf_counter()))
        return out


@pytest.fixture
def worker(real_redis: redis.Redis) -> Iterator[Worker]:
    w = Worker(TimedSleep(), RedisTransport(real_redis, "cb", consumer_name="cb"),
               WorkerSettings(worker_id="cb", block_ms=5, await_ms=2, gather_ms=1.0, max_batch=SESSIONS))
    w.start()
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    yield w
    w.request_stop()
    t.join(30)


def specs(w: Worker, tag: str) -> list[tuple[SessionSpec, list[int]]]:
    hop = RouteHop(worker_id="cb", key=w.keys["prefill"])
    return [(SessionSpec(session_id=f"{tag}{i}", account_id="a", route=(hop,), max_tokens=TOKENS), [3, 4, 5 + i])
            for i in range(SESSIONS)]


def gaps_ms(w: Worker) -> list[float]:
    """Time between one decode call's end and the next one's start, while every session decodes."""
    calls = w.engine.decode  # type: ignore[attr-defined]
    return [(b[0] - a[1]) * 1e3 for a, b in itertools.pairwise(calls)]


def check(w: Worker, handles: dict[str, SessionHandle], slow_reads: int) -> None:
    assert all(h.status == "finished" and len(h.generated) == TOKENS for h in handles.values())
    assert slow_reads >= 5, "the callback was not slow often enough to test anything"
    gaps = sorted(gaps_ms(w))
    # With its credit, a worker never waits for the Tracker: a decode call follows the last one after its own
    # loop's work. Had the callbacks run before the pushes (the drivers before issue 22), the credit would have
    # run out at every read that pushes, and the worker waited SLOW_S - (the tokens left) steps (~30 ms) each
    # time; an asyncio driver that awaited its callbacks in its reader waited for all of them (~500 ms).
    assert len(gaps) >= TOKENS - 2
    assert gaps[int(0.95 * len(gaps))] < 8.0, gaps[-20:]
    assert sum(g > 15.0 for g in gaps) <= 1 and gaps[-1] < 100.0, gaps[-20:]


def test_a_slow_callback_does_not_slow_the_worker_sync(real_redis: redis.Redis, worker: Worker) -> None:
    slow = 0
    last = 0.0

    def on_result(h: SessionHandle, r: StepResult) -> None:
        nonlocal slow, last
        if time.perf_counter() - last > SLOW_S / 2:  # once per read: the first answer of each
            slow += 1
            time.sleep(SLOW_S)
            last = time.perf_counter()

    handles = Producer(real_redis, timeout_s=30).run_many(specs(worker, "s"), on_result=on_result)
    check(worker, handles, slow)


def test_a_slow_callback_does_not_slow_the_worker_async(redis_server: LocalRedis, real_redis: redis.Redis,
                                                        worker: Worker) -> None:
    slow = 0

    async def on_result(h: SessionHandle, r: StepResult) -> None:
        nonlocal slow
        if r.token is not None and h.session_id.endswith("0") and slow < 20:  # a slow client of one session
            slow += 1
            await asyncio.sleep(SLOW_S)

    async def main() -> dict[str, SessionHandle]:
        client = aioredis.Redis.from_url(redis_server.url)
        async with AsyncProducer(client, timeout_s=30) as p:
            out = await p.run_many(specs(worker, "a"), on_result=on_result)
        await client.aclose()
        return out

    check(worker, asyncio.run(main()), slow)
