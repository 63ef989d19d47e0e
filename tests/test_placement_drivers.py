"""Both drivers place sessions opened from a SessionTemplate (producer/placement.py) on the workers that
advertise the key, by load; a draining or stale worker gets none; a named worker works as before."""

from __future__ import annotations

import json
import time

import pytest
import redis

from producer import SessionTemplate
from schemas import WorkerKeys
from tests.producer_drivers import MakeProducer, make_producer
from tests.test_producer import FakeWorker, expected_tokens
from tests.test_transport import make_key, make_spec

__all__ = ["make_producer"]


def template(sid: str, max_tokens: int = 3) -> SessionTemplate:
    return SessionTemplate(session_id=sid, account_id="acct-1", keys=(make_key("prefill"),),
                           options={"max_tokens": max_tokens})


def test_templates_are_spread_over_the_fleet_by_load(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    workers = [FakeWorker(redis_client, worker_id=f"w{i}") for i in range(3)]
    for w in workers:
        w.t.heartbeat({"slots": 4, "busy_slots": 0})
    p = make_producer(redis_client)
    still_pending: list[str] = []

    def on_result(h: object, r: object) -> None:  # at a session's first token its rows are no longer pending
        if r.token is not None and r.position == 2 and r.session_id in p.core.fleet.prefilling:  # type: ignore[attr-defined]
            still_pending.append(r.session_id)  # type: ignore[attr-defined]

    with workers[0], workers[1], workers[2]:
        sessions = [(template(f"s{i}"), [1, 2]) for i in range(9)]
        out = p.run_many(sessions, on_result=on_result)
    assert still_pending == []
    per: dict[str, int] = {}
    for sid, h in out.items():
        assert h.status == "finished" and h.generated == expected_tokens(sid, 2, 3)
        per[h.worker_id] = per.get(h.worker_id, 0) + 1
    assert per == {"w0": 3, "w1": 3, "w2": 3}  # 4 slots each, 9 sessions: balanced, none full
    stats = p.fleet()
    assert {w: s["placed"] for w, s in stats.items()} == per
    # each session's prompt rows counted as pending on its worker until its first token, none left after the run
    view = p.core.fleet
    assert view.prefilling == {} and view.pending == {}
    assert all(c.pending == 0 for c in view.candidates.values())


def test_a_draining_or_stale_worker_gets_no_session(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    live, draining, _stale = (FakeWorker(redis_client, worker_id=w) for w in ("live", "drain", "stale"))
    live.t.heartbeat({"slots": 1, "busy_slots": 1})  # full: still the only one eligible
    draining.t.heartbeat({"slots": 8, "busy_slots": 0, "draining": True})
    old = {"ts": time.time() - 60, "worker_id": "stale", "slots": 8, "busy_slots": 0}
    redis_client.set(WorkerKeys("stale").heartbeat, json.dumps(old))
    p = make_producer(redis_client)
    with live:
        out = p.run_many([(template(f"d{i}"), [3]) for i in range(3)])
    assert {h.worker_id for h in out.values()} == {"live"}
    assert all(h.status == "finished" for h in out.values())


def test_generate_and_open_take_a_template_and_a_named_worker_still_works(redis_client: redis.Redis,
                                                                          make_producer: MakeProducer) -> None:
    a, b = FakeWorker(redis_client, worker_id="a"), FakeWorker(redis_client, worker_id="b")
    a.t.heartbeat({"slots": 2, "busy_slots": 2})
    b.t.heartbeat({"slots": 2, "busy_slots": 0})
    p = make_producer(redis_client)
    with a, b:
        assert list(p.generate(template("g1"), [5, 6])) == expected_tokens("g1", 2, 3)
        named = p.run_many([(make_spec("n1", worker="a", max_tokens=2), [5])])
    assert named["n1"].worker_id == "a" and named["n1"].status == "finished"
    assert p.fleet()["b"]["placed"] == 1 and p.fleet()["a"]["refused_full"] == 1


def test_no_worker_for_the_key_is_a_lookup_error(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    FakeWorker(redis_client, worker_id="other").t.heartbeat({"slots": 2, "draining": True})
    p = make_producer(redis_client)
    with pytest.raises(LookupError, match="no worker to place"):
        p.run_many([(template("x1"), [1])])
