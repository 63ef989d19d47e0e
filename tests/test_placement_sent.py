"""What a Tracker sent a worker counts as held there only while the same worker process runs (producer/placement.py
`FleetView._forget_sent`): a restart (its heartbeat names another pid or start) empties its prefix cache, and a
worker that beats no more is forgotten (a Tracker's memory is bounded by the workers that beat)."""

from __future__ import annotations

import time

from producer import ProducerCore, SessionTemplate, WorkerInfo
from schemas.limits import WIRE_VERSION
from tests.test_transport import make_key

KEYS = [make_key("prefill"), make_key("decode")]
SYSTEM = list(range(10, 10 + 64))  # four blocks of 16 tokens


def fleet(started: dict[str, float], alive: set[str]) -> list[WorkerInfo]:
    return [WorkerInfo(worker_id=w, keys=KEYS, info={"wire_version": WIRE_VERSION}, alive=w in alive,
                       heartbeat_age_s=0.0 if w in alive else None,
                       heartbeat={"ts": time.time(), "slots": 8, "busy_slots": 0, "pid": 7, "started_at": t}
                       if w in alive else {})
            for w, t in started.items()]


def place(core: ProducerCore, sid: str, own: int) -> str:
    t = SessionTemplate(session_id=sid, account_id="a", keys=(KEYS[0],))
    return core.place_loaded(t, SYSTEM + [own] * 16).route[0].worker_id


def test_sent_prompts_are_forgotten_when_the_worker_restarts_or_stops_beating() -> None:
    core = ProducerCore()
    started = {"w1": 100.0, "w2": 100.0}
    core.fleet.load(fleet(started, {"w1", "w2"}), time.monotonic())
    first = place(core, "s1", 1)
    assert place(core, "s2", 2) == first  # the system prompt sent there: held, as far as this Tracker knows
    assert core.fleet.last[first].cached_blocks == 4
    core.fleet.load(fleet(started, {"w1", "w2"}), time.monotonic())  # the same processes: still held
    assert core.fleet.candidates[first].sent
    started[first] = 200.0  # restarted: its cache is empty
    core.fleet.load(fleet(started, {"w1", "w2"}), time.monotonic())
    assert not core.fleet.candidates[first].sent and first not in core.fleet.sent
    other = "w2" if first == "w1" else "w1"
    core.fleet.load(fleet(started, {other}), time.monotonic())  # it beats no more: forgotten
    assert first not in core.fleet.sent and first not in core.fleet.candidates
