"""Reaper: sessions idle past the TTL are cancelled once, through the cancellation stream."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis

from consumer.ops.common import redis_time_ms
from consumer.ops.jobs import reap_job
from consumer.ops.reaper import open_sessions, reap
from dgrtools.localredis import LocalRedis
from schemas import Reason, Status, StepResult, WorkerKeys
from schemas.accounting import pack_tally, parse_tally
from tests.test_ops_support import close, push, read_all, register, serve, step_job
from tests.transport_support import Completion, complete_entries


def age(client: redis.Redis, worker: str, session: str, seconds: float) -> None:
    """Make the session's last answer `seconds` old (its tally's `t`: the server's clock at that answer)."""
    keys = WorkerKeys(worker)
    t = parse_tally(client.hget(keys.tally, session))  # type: ignore[arg-type]
    assert t is not None
    t["t"] = str(redis_time_ms(client) // 1000 - int(seconds))
    client.hset(keys.tally, session, pack_tally(t))


def test_idle_sessions_are_cancelled_once(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    serve(t, {"idle": ("a", 0), "busy": ("a", 0), "done": ("a", 0), "cancelled": ("a", 0)})
    age(redis_client, "w1", "idle", 120)
    age(redis_client, "w1", "done", 120)
    age(redis_client, "w1", "cancelled", 120)
    close(t, "done", "finished")  # closed: no longer in the tally
    redis_client.set(t.keys.cancel_marker("cancelled"), "1")  # cancelled by its Tracker: not reaped again
    assert open_sessions(redis_client, "w1") == ["busy", "idle"]
    t.cancellations()  # the worker's cursor is past anything older

    dry = {x.session_id: x for x in reap(redis_client, 60, dry_run=True)}
    assert dry["idle"].status == "idle" and dry["idle"].idle_s is not None and dry["idle"].idle_s >= 119
    assert dry["busy"].status == "active" and set(dry) == {"idle", "busy"}
    assert redis_client.xlen(t.keys.cancellations) == 0

    rows = {x.session_id: x.status for x in reap(redis_client, 60, who="ops-test")}
    assert rows == {"idle": "cancelled", "busy": "active"}
    # The worker reads them like any cancellation.
    assert t.cancellations()[0] == ["idle"]
    assert b"ops-test" in (redis_client.get(t.keys.cancel_marker("idle")) or b"")
    # Once only: a reaped session is not cancelled again, and no longer open.
    assert open_sessions(redis_client, "w1") == ["busy"]
    assert {x.status for x in reap(redis_client, 60)} == {"active"}
    assert redis_client.xlen(t.keys.cancellations) == 1


def test_a_result_just_in_time_saves_the_session(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    serve(t, {"s": ("a", 0)})
    age(redis_client, "w1", "s", 30)
    serve(t, {"s": ("a", 1)})  # a new answer: the script re-checks the tally, not a cached list
    assert [x.status for x in reap(redis_client, 10)] == ["active"]
    assert redis_client.xlen(t.keys.cancellations) == 0


def test_reap_job(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    t = register(real_redis, "w1")
    serve(t, {"s": ("a", 0)})
    time.sleep(0.05)
    age(real_redis, "w1", "s", 5)
    out = reap_job(redis_server.url, ttl_s=1)
    assert out["cancelled"] == 1 and out["sessions"][0]["session_id"] == "s"


def test_the_worker_frees_the_slot_of_a_reaped_session(redis_server: LocalRedis, real_redis: redis.Redis,
                                                       tiny_model_path: Path) -> None:
    """A producer opens a session, gets its first token and goes away: the reaper cancels it and the
    worker releases its slot (the heartbeat's busy_slots drops back)."""
    from consumer.engines.reference import NumpyReferenceEngine
    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from producer import Producer
    from schemas import RouteHop, SessionSpec

    eng = NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=64)
    worker = Worker(eng, RedisTransport(redis.Redis.from_url(redis_server.url), "rw", "rw-c"),
                    WorkerSettings(worker_id="rw", heartbeat_s=0.05))
    worker.start()
    th = threading.Thread(target=worker.run, daemon=True)
    th.start()
    hb = WorkerKeys("rw").heartbeat

    def busy() -> int:
        raw = real_redis.get(hb)
        return int(json.loads(raw)["busy_slots"]) if raw else -1

    try:
        prod = Producer(redis.Redis.from_url(redis_server.url), timeout_s=30)
        key = prod.discover("rw").keys[0]
        h = prod.open(SessionSpec(session_id="walked-away", account_id="a", route=(RouteHop(worker_id="rw", key=key),),
                                  max_tokens=16), [3, 4, 5])
        while not prod.read_results([h], block_ms=1000):
            pass
        assert h.generated and not h.finished
        wait_for(lambda: busy() == 1)
        time.sleep(0.3)
        (row,) = reap(real_redis, 0.2, who="test")
        assert row.session_id == "walked-away" and row.status == "cancelled"
        wait_for(lambda: busy() == 0)
        assert open_sessions(real_redis, "rw") == []
    finally:
        worker.request_stop()
        th.join(30)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_sessions_the_worker_never_held_are_not_open(redis_client: redis.Redis) -> None:
    """A step rejected for a session the worker does not hold names no account: no tally, nothing to reap."""
    t = register(redis_client, "w1")
    push(redis_client, "w1", [step_job("stray", 3)])
    (d,) = read_all(t)
    r = StepResult(job_id="stray-3", session_id="stray", status=Status.STATE_LOST, reason=Reason.UNKNOWN_SESSION,
                   position=3, worker_id="w1")
    assert complete_entries(t, [Completion(d, r, None)]) == [True]
    assert open_sessions(redis_client, "w1") == []
    assert reap(redis_client, 0) == []
