"""Continuation jobs end to end on the real redis-server: the producer's credit window (decode_n) and
the worker in a thread, through the completion script. What Redis holds afterwards is counted: one
result entry and one charge per token, none after a stop, every input entry acked, a twice-pushed
continuation answered once per (job, offset). The tokens are checked against each session alone
(tests/test_continuation.py's history engine: a wrong row changes every later token)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from producer import Producer
from producer.commands import Batch
from schemas import GROUP, RouteHop, Sampling, SessionSpec, WorkerKeys, job_to_fields
from schemas.step import result_job_id
from tests.support import session_results
from tests.test_continuation import HistoryEngine, Sess, oracle

_wids = itertools.count()


class Running:
    def __init__(self, client: redis.Redis, n_slots: int = 8) -> None:
        self.wid = f"cont{next(_wids)}"
        self.worker = Worker(HistoryEngine(n_slots), RedisTransport(client, self.wid, consumer_name=self.wid),
                             WorkerSettings(worker_id=self.wid, block_ms=5, await_ms=2, gather_ms=1.0))
        self.worker.start()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.worker.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def running(real_redis: redis.Redis) -> Iterator[Running]:
    r = Running(real_redis)
    yield r
    r.stop()


def _spec(w: Running, sid: str, s: Sess, stops: tuple[int, ...] = ()) -> SessionSpec:
    hop = RouteHop(worker_id=w.wid, key=w.worker.keys["prefill"])
    return SessionSpec(session_id=sid, account_id="acct-c", route=(hop,), max_tokens=s.max_tokens, stop_tokens=stops,
                       sampling=s.sampling)


def _results(client: redis.Redis, wid: str, sid: str) -> list[object]:
    return session_results(client, wid, sid)


def _pending(client: redis.Redis, w: Running) -> int:
    """Entries read and not acked, waiting (up to 10 s) for the worker to answer what the producer pushed
    last (a continuation pushed ahead is answered after the session's handle already ended)."""
    streams = w.worker.transport.streams  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        n = sum(int(client.xpending(name, GROUP)["pending"]) + _lag(client, name) for name in streams
                if client.exists(name))
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.01)


def _lag(client: redis.Redis, stream: str) -> int:
    """1 while the stream's last entry was not delivered to the worker's group yet."""
    (group,) = client.xinfo_groups(stream)
    return int(group["last-delivered-id"] != client.xinfo_stream(stream)["last-generated-id"])


def test_results_charges_and_acks_per_token(real_redis: redis.Redis, running: Running) -> None:
    sessions = [Sess(prompt=(5, 6, 7 + i), max_tokens=m, n=16, sampling=Sampling(temperature=0.9, seed=i))
                for i, m in enumerate((1, 2, 17, 40, 33))]
    stopping = Sess(prompt=(9, 9), max_tokens=40, n=16)
    stop = (oracle(stopping)[4],)
    specs = [(_spec(running, f"e{i}", s), list(s.prompt)) for i, s in enumerate(sessions)]
    specs.append((_spec(running, "stop", stopping, stop), list(stopping.prompt)))
    producer = Producer(real_redis, timeout_s=30, decode_n=16)
    handles = producer.run_many(specs)
    wants = [oracle(s) for s in sessions] + [oracle(stopping, stop)]
    for (spec, _), want in zip(specs, wants, strict=True):
        h = handles[spec.session_id]
        assert h.credit.n == 16  # the worker advertised continuation
        assert (h.status, h.generated) == ("finished", want)
        results = _results(real_redis, running.wid, spec.session_id)
        tokens = [r for r in results if r.token is not None]  # type: ignore[attr-defined]
        assert [r.token for r in tokens] == want  # type: ignore[attr-defined]
        assert len({r.job_id for r in results}) == len(results)  # type: ignore[attr-defined]
        charged = real_redis.hget(WorkerKeys(running.wid).session_account(spec.session_id), "generated_tokens")
        assert int(charged or 0) == len(want)
    # the stop at token 5 of 40: the credit pushed ahead is answered without a token and charged nothing
    late = [r for r in _results(real_redis, running.wid, "stop") if r.token is None]  # type: ignore[attr-defined]
    assert all(r.reason == "finished" and r.accounting.generated_tokens == 0 for r in late)  # type: ignore[attr-defined]
    assert _pending(real_redis, running) == 0


def test_twice_pushed_continuation_is_answered_once_per_offset(real_redis: redis.Redis, running: Running) -> None:
    s = Sess(prompt=(4, 5, 6), max_tokens=12, n=4)
    spec = _spec(running, "dup", s)
    producer = Producer(real_redis, timeout_s=30, decode_n=4)
    h = producer.open(spec, list(s.prompt))
    while not h.generated:
        producer.read_results([h], block_ms=200)
    # the producer pushes the first decode job; copies of it follow (as a re-push after an outage would):
    # twins of the job while the worker holds it, duplicates after, never a second answer per offset
    batch = Batch()
    assert producer.core.advance(batch, h, True)
    producer._send(batch)
    (job,) = h.credit.jobs.values()
    assert job.n == 4 and job.tokens == (h.generated[-1],)
    stream = h.input_stream("decode")
    for _ in range(2):
        real_redis.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]
    done = producer.drive([h])["dup"]
    assert (done.status, done.generated) == ("finished", oracle(s))
    results = _results(real_redis, running.wid, "dup")
    ids = [r.job_id for r in results]  # type: ignore[attr-defined]
    assert len(ids) == len(set(ids))
    assert [result_job_id(job.job_id, k) in ids for k in range(4)] == [True] * 4
    assert [r.token for r in results if r.token is not None] == oracle(s)  # type: ignore[attr-defined]
    # one more copy once the session finished: acked, and nothing new in the result stream
    real_redis.xadd(stream, job_to_fields(job))  # type: ignore[arg-type]
    assert _pending(real_redis, running) == 0
    assert len(_results(real_redis, running.wid, "dup")) == len(results)


def test_cancel_between_continuations(real_redis: redis.Redis, running: Running) -> None:
    s = Sess(prompt=(7, 8), max_tokens=40, n=4)
    spec = _spec(running, "cx", s)
    producer = Producer(real_redis, timeout_s=30, decode_n=4)
    cancelled = []

    def on_result(h: object, r: object) -> None:
        if not cancelled and len(h.generated) >= 6:  # type: ignore[attr-defined]
            cancelled.append(1)
            producer.cancel(running.wid, "cx")

    h = producer.run_many([(spec, list(s.prompt))], on_result=on_result)["cx"]
    want = oracle(s)
    assert h.status in ("cancelled", "finished") and h.generated == want[:len(h.generated)]
    results = _results(real_redis, running.wid, "cx")
    charged = real_redis.hget(WorkerKeys(running.wid).session_account("cx"), "generated_tokens")
    assert int(charged or 0) == len([r for r in results if r.token is not None]) == len(h.generated)  # type: ignore[attr-defined]
    assert _pending(real_redis, running) == 0


def test_xack_of_no_entry_acks_nothing(real_redis: redis.Redis) -> None:
    """The worker publishes a continuation's non-final tokens under a delivery of entry 0-0: Redis
    refuses that id to XADD, so XACK of it never acks a real entry."""
    real_redis.xgroup_create("cont:probe", "g", id="0", mkstream=True)
    with pytest.raises(redis.ResponseError):
        real_redis.xadd("cont:probe", {"a": "1"}, id="0-0")
    real_redis.xadd("cont:probe", {"a": "1"})
    real_redis.xreadgroup("g", "c", {"cont:probe": ">"})
    assert real_redis.xack("cont:probe", "g", "0-0") == 0
    assert int(real_redis.xpending("cont:probe", "g")["pending"]) == 1


def test_resume_mid_continuation_follows_the_same_jobs(real_redis: redis.Redis, running: Running) -> None:
    """A handle rebuilt by resume() in another producer (which never discovered the worker) follows the
    continuation jobs the first one pushed (n is in the session's record) and finishes exactly."""
    s = Sess(prompt=(6, 5, 4), max_tokens=30, n=8)
    spec = _spec(running, "rs", s)
    first = Producer(real_redis, timeout_s=30, decode_n=8)
    h = first.open(spec, list(s.prompt))
    while len(h.generated) < 11:  # into the second decode job
        first.read_results([h], block_ms=200)
        batch = Batch()
        first.core.advance(batch, h, True)
        first._send(batch)
    other = Producer(real_redis, timeout_s=30, decode_n=1)
    again = other.resume(running.wid, "rs")
    assert again.credit.n == 8
    done = other.drive([again])["rs"]
    assert (done.status, done.generated) == ("finished", oracle(s))
    assert _pending(real_redis, running) == 0


def test_async_producer_drives_continuation_jobs(redis_server: object, running: Running) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from producer.aio import AsyncProducer

    sessions = [Sess(prompt=(2, 3, 4 + i), max_tokens=20 + i, n=8) for i in range(3)]

    async def main() -> list[list[int]]:
        client = aioredis.Redis.from_url(redis_server.url)  # type: ignore[attr-defined]
        async with AsyncProducer(client, timeout_s=30, decode_n=8) as p:
            async def one(i: int, s: Sess) -> list[int]:
                return [t async for t in p.generate(_spec(running, f"as{i}", s), list(s.prompt))]

            got = await asyncio.gather(*(one(i, s) for i, s in enumerate(sessions)))
        await client.aclose()
        return list(got)

    assert asyncio.run(main()) == [oracle(s) for s in sessions]
    client = redis.Redis.from_url(redis_server.url)  # type: ignore[attr-defined]
    for i, s in enumerate(sessions):
        results = _results(client, running.wid, f"as{i}")
        assert any("." in r.job_id for r in results)  # type: ignore[attr-defined]  # continuation ids: n was 8
        assert [r.token for r in results if r.token is not None] == oracle(s)  # type: ignore[attr-defined]
    assert _pending(client, running) == 0
    client.close()
