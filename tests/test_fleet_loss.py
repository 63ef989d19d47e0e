"""Sessions outlive their worker (producer/moves.py): a placed session whose worker stops beating is placed
again on another worker with the same key and replayed there; its tokens are its own, and across the fleet
every prompt position and every generated token is charged exactly once (the lost worker's charges stay, the
new worker counts the replay as recomputed)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import redis

from producer import PlacementPolicy, SessionHandle, SessionTemplate
from schemas import StepResult, WorkerKeys
from tests.producer_drivers import MakeProducer, make_producer
from tests.test_producer import FakeWorker, expected_tokens
from tests.test_transport import make_key

__all__ = ["make_producer"]


def charged(client: redis.Redis, workers: list[str], account: str) -> dict[str, float]:
    """The account's counters summed over the workers' account hashes (every charge, closed or open)."""
    out: dict[str, float] = {}
    for w in workers:
        for k, v in client.hgetall(WorkerKeys(w).billing_account(account)).items():
            out[k.decode()] = out.get(k.decode(), 0.0) + float(v)
    return out


def run_with_a_loss(client: redis.Redis, make_producer: MakeProducer, ws: list[FakeWorker], account: str,
                    on_token: Callable[[SessionHandle, StepResult], None] | None = None
                    ) -> tuple[Any, dict[str, SessionHandle], list[str]]:
    """Six placed sessions (5-token prompts, 12 tokens) on the fake workers `ws`; once one has 3 tokens its worker
    dies for good (its thread stopped, its heartbeat key gone): (the driver under test, the handles, the dead
    worker). `on_token`: told each answer with a token, as the Run's callback gets it."""
    for w in ws:
        w.t.heartbeat({"slots": 4, "busy_slots": 0})
    prompts = {f"{account}-{i}": [1 + i, 2, 3, 4, 5] for i in range(6)}
    sessions = [(SessionTemplate(session_id=sid, account_id=account, keys=(make_key("prefill"),),
                                 options={"max_tokens": 12}), p) for sid, p in prompts.items()]
    dead: list[str] = []

    def on_result(h: SessionHandle, r: StepResult) -> None:
        if on_token is not None and r.token is not None:
            on_token(h, r)
        if not dead and len(h.generated) >= 3:  # mid-decode: its worker dies for good
            victim = next(w for w in ws if w.worker_id == h.worker_id)
            victim._stop.set()
            assert victim._thread is not None
            victim._thread.join(5)
            client.delete(WorkerKeys(victim.worker_id).heartbeat)  # as its key expiring
            dead.append(victim.worker_id)

    p = make_producer(client, decode_n=1, placement=PlacementPolicy(lost_s=5.0, lost_check_s=0.05))
    for w in ws:
        w.__enter__()
    try:
        out = p.run_many(sessions, on_result=on_result)
    finally:
        for w in ws:
            if w.worker_id not in dead:
                w.__exit__(None, None, None)
    assert dead
    return p, out, dead


def test_a_lost_workers_sessions_move_and_are_billed_once(redis_client: redis.Redis,
                                                         make_producer: MakeProducer) -> None:
    ws = [FakeWorker(redis_client, worker_id=f"f{i}") for i in range(3)]
    p, out, dead = run_with_a_loss(redis_client, make_producer, ws, "acct-m")
    moved = [h for h in out.values() if h.attempt > 0]
    assert moved and all(h.worker_id != dead[0] for h in out.values())
    for sid, h in out.items():
        assert h.status == "finished", (sid, h.status, h.detail)
        assert h.generated == expected_tokens(sid, 5, 12), sid
    got = charged(redis_client, [w.worker_id for w in ws], "acct-m")
    assert got["prompt_tokens"] == 5 * len(out) and got["generated_tokens"] == 12 * len(out), got
    assert got["recomputed_tokens"] >= 8 * len(moved), got  # at least prompt + 3 generated, per moved session
    stats = p.fleet()
    assert stats[dead[0]]["moved_out"] == len(moved) and stats[dead[0]]["lost"]
    assert sum(s["moved_in"] for s in stats.values()) == len(moved)
    # no prompt rows left pending anywhere, the lost worker's included (a move clears what it was placed with)
    assert p.core.fleet.prefilling == {} and p.core.fleet.pending == {}


def test_a_moved_session_whose_replay_diverges_tells_its_caller_each_token_once(
        redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    """A worker lost mid-decode, and the workers its sessions move to sample the first token of each replay one
    off (a batch-invariant engine breaking its promise): each moved session's replay diverges and is replayed
    again feeding its tokens, and what its caller's callback got, in order, is its tokens once each: neither a
    token it had (sampled again) nor the one that differed (tests/test_continuation.py searches the same)."""
    told: dict[str, list[int]] = {}

    def on_token(h: SessionHandle, r: StepResult) -> None:
        assert r.token is not None
        told.setdefault(h.session_id, []).append(r.token)

    ws = [FakeWorker(redis_client, worker_id=f"d{i}", diverge_replays=True) for i in range(3)]
    _, out, _ = run_with_a_loss(redis_client, make_producer, ws, "acct-v", on_token)
    moved = [h for h in out.values() if h.attempt > 0]
    assert moved and all(h.diverged and h.attempt == 2 for h in moved), \
        [(h.session_id, h.attempt, h.diverged) for h in moved]
    for sid, h in out.items():
        assert h.status == "finished" and h.generated == expected_tokens(sid, 5, 12), (sid, h.status, h.detail)
        assert told[sid] == h.generated, (sid, told[sid], h.generated)


def test_a_silent_worker_keeps_its_sessions_until_the_bound(redis_client: redis.Redis) -> None:
    """Within lost_s nothing moves (a pause, a flap); past it the sessions move once and stay moved."""
    from producer import Producer

    a, b = FakeWorker(redis_client, worker_id="sa"), FakeWorker(redis_client, worker_id="sb")
    now = time.time()
    for w in (a, b):
        redis_client.set(WorkerKeys(w.worker_id).heartbeat, json.dumps({"ts": now, "slots": 1, "busy_slots": 0}))
    p = Producer(redis_client, decode_n=1, placement=PlacementPolicy(lost_s=2.0, lost_check_s=0.0))
    h = p.open(SessionTemplate(session_id="q1", account_id="acct", keys=(make_key("prefill"),),
                               options={"max_tokens": 4}), [1, 2])
    first = h.worker_id
    run = p.core.start([], resume=[h])
    p._call(p.core.move_lost())
    assert h.worker_id == first and h.attempt == 0  # fresh beat: stays
    old = json.dumps({"ts": now - 10, "slots": 1, "busy_slots": 0})
    redis_client.set(WorkerKeys(first).heartbeat, old)
    assert p._call(p.core.move_lost()) == [h]
    second = h.worker_id
    assert second != first and h.status == "state_lost" and h.reason == "worker_lost"
    redis_client.set(WorkerKeys(first).heartbeat, json.dumps({"ts": time.time(), "slots": 1, "busy_slots": 0}))
    assert p._call(p.core.move_lost()) == [] and h.worker_id == second  # the first is back: nothing bounces
    p.core.stop(run)


def test_a_session_cancelled_on_its_lost_worker_is_not_moved(redis_client: redis.Redis,
                                                             make_producer: MakeProducer) -> None:
    """A cancel sent to a session's worker just before that worker is lost (its marker set there) ends the session
    cancelled: the move reads the markers on the lost worker first, so the session is not replayed elsewhere."""
    marked: list[str] = []

    def on_token(h: SessionHandle, r: StepResult) -> None:
        if not marked and len(h.generated) >= 3:  # the session whose worker dies right after this answer
            redis_client.set(WorkerKeys(h.worker_id).cancel_marker(h.session_id), "1", ex=60)
            marked.append(h.session_id)

    ws = [FakeWorker(redis_client, worker_id=f"c{i}") for i in range(3)]
    _, out, _ = run_with_a_loss(redis_client, make_producer, ws, "acct-x", on_token)
    (sid,) = marked
    assert (out[sid].status, out[sid].attempt) == ("cancelled", 0), (out[sid].status, out[sid].detail)
    for other, h in out.items():  # the lost worker's other sessions moved and finished
        if other != sid:
            assert h.status == "finished" and h.generated == expected_tokens(other, 5, 12), (other, h.status)
