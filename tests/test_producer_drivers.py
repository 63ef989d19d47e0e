"""What both drivers must do beyond the basic flows of test_producer.py: cancel a running generate(), ride
through a real Redis restart, and (AsyncProducer) serve many tasks at once with one reader per worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from dgrtools.localredis import LocalRedis
from producer.aio import AsyncProducer
from schemas import WorkerKeys
from tests.chaos_support import RestartableRedis
from tests.producer_drivers import MakeProducer, async_client_for, make_producer
from tests.support import ConsumerProcess
from tests.test_producer import FakeWorker, expected_tokens, results_of
from tests.test_transport import WORKER, make_spec

__all__ = ["make_producer"]


def test_cancel_ends_a_running_generate(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    p = make_producer(redis_client, timeout_s=10)
    tokens = []
    with FakeWorker(redis_client):
        for t in p.generate(make_spec("cg", max_tokens=200), [1, 2, 3]):
            tokens.append(t)
            if len(tokens) == 3:
                p.cancel(WORKER, "cg")
    # the tokens before the cancel landed are the session's own; then it ended without an error
    assert 3 <= len(tokens) < 200 and tokens == expected_tokens("cg", 3, len(tokens))
    assert results_of(redis_client, WORKER, "cg")[-1].status.value == "cancelled"
    assert p.cancelled(WORKER, "cg")


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RestartableRedis]:
    srv = RestartableRedis(tmp_path / "redis")
    srv.start()
    yield srv
    srv.stop()


@pytest.mark.timeout(120)
def test_a_redis_restart_mid_run(restartable: RestartableRedis, make_producer: MakeProducer) -> None:
    """Redis shuts down and comes back on the same port and data dir: every session ends with its own
    tokens, each job answered once, and the producer saw the outage."""
    client = redis.Redis.from_url(restartable.url)
    p = make_producer(client, prefill_chunk=4, timeout_s=60, outage_max_s=60)
    specs = [(make_spec(f"rr{i}", max_tokens=40), list(range(1, 6 + i))) for i in range(4)]
    out: dict[str, Any] = {}
    with FakeWorker(client):
        drive = threading.Thread(target=lambda: out.update(p.run_many(specs)), daemon=True)
        drive.start()
        while sum(len(results_of(client, WORKER, s.session_id)) for s, _ in specs) < 12:
            time.sleep(0.01)
        restartable.shutdown()
        time.sleep(1.5)  # longer than redis-py's own retries: the driver's ride-through is what is tested
        restartable.start()
        drive.join(90)
        assert not drive.is_alive()
    assert p.outages >= 1, "the producer never saw the outage: the test did not test it"
    for spec, prompt in specs:
        h = out[spec.session_id]
        assert h.status == "finished" and h.generated == expected_tokens(spec.session_id, len(prompt), 40)
        ids = [r.job_id for r in results_of(client, WORKER, spec.session_id)]
        assert len(ids) == len(set(ids)) == 2 + 39  # two prefill chunks, 39 decode steps: each answered once


def test_many_tasks_share_one_reader_per_worker(redis_client: redis.Redis) -> None:
    """40 concurrent generate() tasks: right tokens each, and never two result reads in flight for one
    worker; every read names one stream, this Tracker's, which carries every session's answers."""
    n = 40
    in_flight = peak = 0
    streams_read: list[list[str]] = []
    tracker = ""

    async def main() -> dict[str, list[int]]:
        nonlocal in_flight, peak
        client = async_client_for(redis_client)
        orig = client.xread

        async def xread(streams: dict[Any, Any], *a: Any, **k: Any) -> Any:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            streams_read.append([s.decode() if isinstance(s, bytes) else s for s in streams])
            try:
                return await orig(streams, *a, **k)
            finally:
                in_flight -= 1

        client.xread = xread  # type: ignore[method-assign]
        async with AsyncProducer(client, prefill_chunk=4, timeout_s=20) as p:
            nonlocal tracker
            tracker = p.tracker_id
            async def one(i: int) -> tuple[str, list[int]]:
                return f"t{i}", [t async for t in p.generate(make_spec(f"t{i}", max_tokens=5), [1] * (1 + i % 7))]

            got = dict(await asyncio.gather(*(one(i) for i in range(n))))
        await client.aclose()
        return got

    with FakeWorker(redis_client):
        got = asyncio.run(main())
    for i in range(n):
        assert got[f"t{i}"] == expected_tokens(f"t{i}", 1 + i % 7, 5)
    assert peak == 1
    assert {s for names in streams_read for s in names} == {WorkerKeys(WORKER).results(tracker)}


def test_tracker_sim_async_drives_a_consumer_and_cancels_on_purpose(redis_server: LocalRedis, tiny_model_path: Path,
                                                                    tmp_path: Path) -> None:
    proc = ConsumerProcess(redis_server.url, "sim-async", tiny_model_path, tmp_path, slots=6)  # no capacity refusal
    try:
        out = tmp_path / "sim.json"
        run = subprocess.run([sys.executable, "-m", "consumer", "tracker-sim", "--async", "--redis-url",
                              redis_server.url, "--worker-id", "sim-async", "--sessions", "6", "--prompt-len", "4:20",
                              "--max-tokens", "8", "--rate", "50", "--cancel-fraction", "0.34", "--seed", "4",
                              "--decode-n", "1",  # one job per token: the cancel at token 4 lands before token 8
                              "--json-out", str(out)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "(asyncio)" in run.stdout and "tok/s" in run.stdout
        sessions = json.loads(out.read_text())["sessions"]
        assert sorted(s["status"] for s in sessions) == ["cancelled"] * 2 + ["finished"] * 4
        assert all(len(s["generated"]) == 8 for s in sessions if s["status"] == "finished")
        assert all(len(s["generated"]) < 8 for s in sessions if s["status"] == "cancelled")
    finally:
        assert proc.stop() == 0, proc.log()


def test_read_results_over_two_workers(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    """One read per worker; what one worker answered is returned, the other's sessions are read on later."""
    w1, w2 = FakeWorker(redis_client), FakeWorker(redis_client, worker_id="w2")
    p = make_producer(redis_client)
    h1 = p.open(make_spec("tw1", max_tokens=3), [1, 2])
    h2 = p.open(make_spec("tw2", worker="w2", max_tokens=3), [1, 2])
    w1.step()
    block = 0 if isinstance(redis_client, fakeredis.FakeRedis) else 200  # fakeredis: see producer_drivers.py
    got = p.read_results([h1, h2], block_ms=block)
    assert set(got) == {"tw1"} and h1.generated == expected_tokens("tw1", 2, 1) and h2.generated == []
    w2.step()
    while "tw2" not in p.read_results([h1, h2], block_ms=block):
        pass
    assert h2.generated == expected_tokens("tw2", 2, 1)


def test_answers_written_below_the_cursor_after_a_failover_are_read(redis_client: redis.Redis,
                                                                    make_producer: MakeProducer) -> None:
    """After a failover the new master may lack the tail of a result stream, and its clock may be behind the old
    master's: answers it takes then get ids below the last one the Tracker read. After the outage the Tracker
    reads its streams again from `rewind_ms` earlier: the answer is applied (once), not skipped."""
    from schemas import job_from_fields, results_to_fields
    from schemas.retry import RetryPolicy
    from tests.test_lease import Flaky
    from tests.test_producer import token_at

    w = FakeWorker(redis_client)
    p = make_producer(redis_client, decode_n=1)
    h = p.open(make_spec("fo", max_tokens=3), [1, 2, 3])
    w.step()
    assert p.read_results([h], block_ms=0)
    p.push_decode(h, h.generated[-1])
    stream = WorkerKeys(WORKER).results(p.tracker_id)
    ((last, _),) = redis_client.xrevrange(stream, count=1)
    redis_client.delete(stream)  # the new master: the stream without its tail ...
    (d,) = w.t.read_streams({w.pre: 16, w.dec: 16}, block_ms=0)
    answer, _, _ = w._answer(job_from_fields(d.fields))
    low = f"{int(last.split(b'-')[0]) - 3000}-0"  # ... and a clock 3 s behind the old one's
    redis_client.xadd(stream, results_to_fields([answer]), id=low)  # type: ignore[arg-type]
    driver = getattr(p, "aio", p)
    driver.client = Flaky(driver.client, "xread", 1, redis.ConnectionError("failover"))
    driver._rider.policy = RetryPolicy(max_s=10, base_s=0.001, cap_s=0.002)
    got = p.read_results([h], block_ms=0)
    assert p.outages == 1 and [r.token for r in got["fo"]] == [token_at("fo", 4)]
    assert h.generated == expected_tokens("fo", 3, 2) and h.last_result_id == low
    assert p.read_results([h], block_ms=0) == {}  # read again from earlier: applied once
