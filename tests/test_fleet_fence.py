"""A worker declared lost that was only paused: what it computes for a moved session before it reads the
cancel is neither published nor charged (producer/moves.py writes the fence `WorkerKeys.moved`, the
completion script honours it: consumer/lua/complete.lua), so a moved session is never charged twice. Run on
fakeredis and a real redis-server (the `redis_client` fixture)."""

from __future__ import annotations

import json
import time

import redis

from consumer.transport import Closure, Filing, FusedCallStats
from producer import PlacementPolicy, Producer, SessionHandle, SessionTemplate
from schemas import RouteHop, SessionSpec, Status, WorkerKeys, job_from_fields
from tests.support import session_results
from tests.test_producer import FakeWorker
from tests.test_transport import make_key
from tests.transport_support import Completion, complete_entries


def _beat(client: redis.Redis, worker: str, age_s: float) -> None:
    client.set(WorkerKeys(worker).heartbeat, json.dumps({"ts": time.time() - age_s, "slots": 4, "busy_slots": 0}))


def _compute_without_reading_cancels(w: FakeWorker) -> list[str]:
    """What a resumed worker does in the moment before it reads its cancellations: answer what it read."""
    ds = w.t.read_streams({w.pre: 16, w.dec: 64}, block_ms=0)
    comps = []
    for d in ds:
        result, account, close = w._answer(job_from_fields(d.fields))
        comps.append(Completion(d, result, account, d.phase, close))  # type: ignore[arg-type]
    complete_entries(w.t, comps, call=FusedCallStats("prefill", len(ds), len(ds), 0.001))
    return [job_from_fields(d.fields).session_id for d in ds]


def _charged(client: redis.Redis, worker: str, account: str) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in client.hgetall(WorkerKeys(worker).billing_account(account)).items()}


def _placed(client: redis.Redis, prefix: str, sid: str, account: str
            ) -> tuple[Producer, SessionHandle, FakeWorker, FakeWorker]:
    """Two live FakeWorkers and a session placed on one of them: (producer, handle, its worker, the other)."""
    ws = {w: FakeWorker(client, worker_id=w) for w in (f"{prefix}a", f"{prefix}b")}
    for w in ws:
        _beat(client, w, 0)
    p = Producer(client, decode_n=1, placement=PlacementPolicy(lost_s=2.0, lost_check_s=0.0))
    h = p.open(SessionTemplate(session_id=sid, account_id=account, keys=(make_key("prefill"),),
                               options={"max_tokens": 4}), [1, 2, 3])
    (other,) = (w for wid, w in ws.items() if wid != h.worker_id)
    return p, h, ws[h.worker_id], other


def test_a_paused_worker_charges_nothing_for_the_sessions_moved_off_it(redis_client: redis.Redis) -> None:
    p, h, lost, _ = _placed(redis_client, "f", "mv1", "acct-f")
    run = p.core.start([], resume=[h])
    _beat(redis_client, lost.worker_id, 10)  # silent past lost_s: its sessions move
    assert p._call(p.core.move_lost()) == [h] and h.worker_id != lost.worker_id
    assert redis_client.hget(WorkerKeys(lost.worker_id).moved, "mv1") == b"0"  # attempt 0 fenced there
    # A session opened on the paused worker by name, after the move: not fenced.
    key = make_key("prefill")
    spec = SessionSpec(session_id="kept", account_id="acct-f", route=(RouteHop(worker_id=lost.worker_id, key=key),),
                       max_tokens=4)
    p.open(spec, [4, 5])

    # The paused worker resumes and computes both openings in one call before it reads the cancel.
    assert sorted(_compute_without_reading_cancels(lost)) == ["kept", "mv1"]
    got = _charged(redis_client, lost.worker_id, "acct-f")
    assert got.get("prompt_tokens") == 2 and got.get("generated_tokens") == 1, got  # "kept" only
    assert [r.session_id for r in session_results(redis_client, lost.worker_id, "mv1")] == []  # nothing published
    assert [r.status for r in session_results(redis_client, lost.worker_id, "kept")] == [Status.OK]

    # It reads the cancel and closes the session (a cancel with nothing queued: a closure of its own, as the
    # worker files it): the fence goes with it.
    assert "mv1" in lost.t.cancellations()[0]
    lost.t.complete(Filing(closures=[Closure("mv1", "cancelled", "acct-f")]))
    assert not redis_client.hexists(WorkerKeys(lost.worker_id).moved, "mv1")
    got = _charged(redis_client, lost.worker_id, "acct-f")
    assert got.get("prompt_tokens") == 2 and got.get("generated_tokens") == 1, got
    p.core.stop(run)


def test_what_a_lost_worker_charged_unread_is_not_charged_again(redis_client: redis.Redis) -> None:
    """The lost worker answered (and charged) the opening just before the move and the Tracker never read it:
    the new worker's high-water mark starts past those positions (read from the lost worker's tally after the
    fence), so the replay recomputes them without charging them again."""
    p, h, lost, new = _placed(redis_client, "g", "hw1", "acct-g")
    run = p.core.start([], resume=[h])
    assert _compute_without_reading_cancels(lost) == ["hw1"]  # 3 prompt positions and the token at 3 charged
    assert _charged(redis_client, lost.worker_id, "acct-g")["generated_tokens"] == 1
    _beat(redis_client, lost.worker_id, 10)
    assert p._call(p.core.move_lost()) == [h] and h.worker_id == new.worker_id and not h.generated
    assert redis_client.hget(WorkerKeys(new.worker_id).session_account("hw1"), "hw") == b"4"
    p.core.stop(run)
