"""Steps the transport gives up on (delivered more than max_deliveries times) on the real redis-server: a
worker killed again and again before it made progress delivers every step it held once more per start, so
innocent steps reach the limit. Each is dead-lettered once and its session answered state_lost, so the
Tracker replays it on a new attempt: the session finishes with its tokens alone, billed once, instead of
waiting for ResultTimeout (found by tests/test_chaos.py's kill -9 at random points under DGR_SOAK=1).

Both ways an entry reaches the limit: claimed from dead consumer names (recovery), and re-read from the
worker's own pending list after restarts under the same consumer name (the pending re-read)."""

from __future__ import annotations

import itertools
import threading

import pytest
import redis

from consumer.config import TransportSettings
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from producer import Producer
from schemas import GROUP, RouteHop, SessionSpec, WorkerKeys
from tests.support import session_results
from tests.test_continuation import HistoryEngine, Sess, oracle

_wids = itertools.count()
LIMIT = TransportSettings(max_deliveries=2)


def _worker(client: redis.Redis, wid: str, consumer: str) -> Worker:
    return Worker(HistoryEngine(8), RedisTransport(client, wid, consumer_name=consumer, settings=LIMIT),
                  WorkerSettings(worker_id=wid, block_ms=5, await_ms=2, gather_ms=1.0))


def _read_all(t: RedisTransport) -> int:
    return len(t.read_streams(dict.fromkeys(t.streams, 64), block_ms=0))


@pytest.mark.parametrize("path", ["claimed", "reread"])
def test_steps_delivered_past_the_limit_are_answered_state_lost_and_replayed(real_redis: redis.Redis,
                                                                            path: str) -> None:
    wid = f"given-up{next(_wids)}"
    first = _worker(real_redis, wid, "gen0")
    first.start()
    sessions = {f"s{i}": Sess(prompt=(7, 3 + i, 9), max_tokens=9, n=4) for i in range(3)}
    producer = Producer(real_redis, timeout_s=20, decode_n=4)
    hop = RouteHop(worker_id=wid, key=first.keys["prefill"])
    handles = [producer.open(SessionSpec(session_id=sid, account_id="acct-g", route=(hop,), max_tokens=s.max_tokens),
                             list(s.prompt)) for sid, s in sessions.items()]
    transport = first.transport
    assert isinstance(transport, RedisTransport)
    opened = _read_all(transport)  # delivery 1, then killed before any answer: its lease runs out
    assert opened >= len(sessions)
    transport.release_lease()
    keys = list(first.keys.values())
    second = RedisTransport(real_redis, wid, consumer_name="gen1" if path == "claimed" else "gen0", settings=LIMIT)
    second.register(keys, {})
    if path == "claimed":
        taken, dead = second.recover_streams()  # delivery 2: a dead consumer name's entries claimed
        assert len(taken) == opened and dead == []
    else:
        assert _read_all(second) == opened  # delivery 2: the pending re-read after a restart
    third = _worker(real_redis, wid, "gen2" if path == "claimed" else "gen0")
    third.start()  # delivery 3 > 2: dead-lettered, each session answered state_lost
    thread = threading.Thread(target=third.run, daemon=True)
    thread.start()
    try:
        done = producer.drive(handles)
    finally:
        third.request_stop()
        thread.join(timeout=30)
    for sid, s in sessions.items():
        h = done[sid]
        assert (h.status, h.generated, h.attempt) == ("finished", oracle(s), 1)
        lost = [r for r in session_results(real_redis, wid, sid) if r.status == "state_lost"]  # type: ignore[attr-defined]
        assert lost and all(r.reason == "too_many_deliveries" for r in lost)  # type: ignore[attr-defined]
        charged = real_redis.hget(WorkerKeys(wid).session_account(sid), "generated_tokens")
        assert int(charged or 0) == len(oracle(s))  # billed once
    dlq = real_redis.xrange(WorkerKeys(wid).dead_letters)
    assert len(dlq) == opened and {f[b"reason"] for _, f in dlq} == {b"too_many_deliveries"}
    assert sum(int(real_redis.xpending(name, GROUP)["pending"]) for name in transport.streams) == 0


def test_a_twin_of_an_answered_step_given_up_is_not_answered_again(real_redis: redis.Redis) -> None:
    """A twin of a step already answered (the Tracker re-pushes what it did not read after an outage) that reaches
    the limit is acked without an answer, as any delivery of an answered job: never a second answer under its id
    (found by tests/test_chaos.py's random schedule of faults under DGR_SOAK=1, seed 23: 'a job answered twice')."""
    wid = f"given-up{next(_wids)}"
    first = _worker(real_redis, wid, "gen0")
    first.start()
    thread = threading.Thread(target=first.run, daemon=True)
    thread.start()
    s = Sess(prompt=(7, 3, 9), max_tokens=5, n=1)
    producer = Producer(real_redis, timeout_s=20, decode_n=1)
    hop = RouteHop(worker_id=wid, key=first.keys["prefill"])
    try:
        done = producer.run_many([(SessionSpec(session_id="twin", account_id="acct-g", route=(hop,),
                                               max_tokens=s.max_tokens), list(s.prompt))])
    finally:
        first.request_stop()
        thread.join(timeout=30)
    assert done["twin"].generated == oracle(s)
    before = session_results(real_redis, wid, "twin")
    transport = first.transport
    assert isinstance(transport, RedisTransport)
    decode = next(st for st in transport.streams if st.endswith(":decode"))
    _id, fields = real_redis.xrange(decode, count=1)[0]
    real_redis.xadd(decode, fields)  # the twin of the session's first decode step, answered long ago
    second = RedisTransport(real_redis, wid, consumer_name="gen1", settings=LIMIT)
    second.register(list(first.keys.values()), {})
    assert _read_all(second) == 1  # delivery 1, then killed
    third = RedisTransport(real_redis, wid, consumer_name="gen2", settings=LIMIT)
    third.register(list(first.keys.values()), {})
    assert len(third.recover_streams()[0]) == 1  # delivery 2, then killed
    last = _worker(real_redis, wid, "gen3")
    last.start()  # delivery 3 > 2: given up, known as answered
    last.request_stop()
    assert session_results(real_redis, wid, "twin") == before  # no second answer
    assert len(real_redis.xrange(WorkerKeys(wid).dead_letters)) == 1
    assert sum(int(real_redis.xpending(name, GROUP)["pending"]) for name in transport.streams) == 0
