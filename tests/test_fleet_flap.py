"""A flapping worker (issue 33, point 5): its heartbeat goes out (older than lost_s) and fresh again, over and
over, while sessions arrive and decode. Sessions move away from it when it is out, never back (producer/moves.py):
no session runs on a worker it left, none moves twice, every one ends with its own tokens, charged exactly once
across the fleet, the job the flapper held when declared out included (docs/accounting.md, "Across workers")."""

from __future__ import annotations

import json
import threading
import time

import redis

from producer import PlacementPolicy, Producer, SessionHandle, SessionTemplate
from schemas import StepResult, WorkerKeys
from tests.test_fleet_loss import charged
from tests.test_producer import FakeWorker, expected_tokens
from tests.test_transport import make_key


def beat(client: redis.Redis, worker_id: str, ts: float) -> None:
    client.set(WorkerKeys(worker_id).heartbeat, json.dumps({"ts": ts, "slots": 8, "busy_slots": 0}))


def test_a_flapping_worker_does_not_make_sessions_move_back_and_forth(redis_client: redis.Redis) -> None:
    ws = [FakeWorker(redis_client, worker_id=f"fl{i}") for i in range(3)]
    for w in ws:
        beat(redis_client, w.worker_id, time.time())
    flapper, stop = ws[0].worker_id, threading.Event()
    flips: list[float] = []

    def flap() -> None:  # out, fresh, out, fresh ... every 30 ms (the worker itself keeps answering)
        out = False
        while not stop.wait(0.03):
            out = not out
            beat(redis_client, flapper, time.time() - (10.0 if out else 0.0))
            for w in ws[1:]:  # the others beat as live workers do: a run longer than lost_s must not lose them
                beat(redis_client, w.worker_id, time.time())
            flips.append(time.monotonic())

    n, tokens, prompt = 12, 30, [1, 2, 3, 4, 5]
    sessions = [(SessionTemplate(session_id=f"fp{i}", account_id="acct-fl", keys=(make_key("prefill"),),
                                 options={"max_tokens": tokens}), prompt) for i in range(n)]
    seen: dict[str, list[str]] = {}

    def on_result(h: SessionHandle, r: StepResult) -> None:
        trail = seen.setdefault(h.session_id, [])
        if not trail or trail[-1] != h.worker_id:
            trail.append(h.worker_id)

    # lost_s 1 s: the flapper's "out" beat is 10 s old; the fleet is read again every 50 ms, so it is placed on
    # again between flaps (discover_cache_s), and the loss check runs every turn.
    p = Producer(redis_client, decode_n=1, discover_cache_s=0.05,
                 placement=PlacementPolicy(lost_s=1.0, lost_check_s=0.0))
    for w in ws:
        w.__enter__()
    th = threading.Thread(target=flap, daemon=True)
    th.start()
    try:
        out = p.run_many(sessions, on_result=on_result, start_times=[0.05 * i for i in range(n)])
    finally:
        stop.set()
        th.join(5)
        for w in ws:
            w.__exit__(None, None, None)
    assert len(flips) >= 4  # it flapped during the run
    moved = [h for h in out.values() if h.attempt > 0]
    assert moved, "no session was ever on the flapper when it was out: the test tested nothing"
    for sid, h in out.items():
        assert h.status == "finished", (sid, h.status, h.detail)
        assert h.generated == expected_tokens(sid, len(prompt), tokens), sid
        assert h.attempt <= 1, (sid, h.attempt, seen.get(sid))  # moved at most once
        trail = seen[sid]
        assert len(trail) == len(set(trail)), (sid, trail)  # never back on a worker it left
        assert all(w != flapper for w in trail[1:]), (sid, trail)  # moved only off the flapper, never onto it
    got = charged(redis_client, [w.worker_id for w in ws], "acct-fl")
    # The flapper is declared out while it still answers (a beat 10 s old, a live worker): the job it holds then
    # may be computed after the move. The fence of the moved attempt (consumer/lua/complete.lua) keeps that from
    # being charged, and what it charged before the fence is carried to the new worker's high-water mark
    # (producer/moves.py carry_high_water): charged exactly once across the fleet (docs/accounting.md).
    assert got["prompt_tokens"] == len(prompt) * n and got["generated_tokens"] == tokens * n, (got, len(moved))
    stats = p.fleet()
    assert stats[flapper]["moved_out"] == len(moved)
    assert sum(s["moved_in"] for s in stats.values()) == len(moved)
    assert p.core.fleet.prefilling == {} and p.core.fleet.pending == {}  # no prompt rows left pending
