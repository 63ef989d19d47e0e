"""The worker loop against an in-memory transport: admission, answers, twins and refusals, no Redis."""

from __future__ import annotations

import itertools
import json

import pytest

from consumer.transport.protocol import Refusal, Transport
from consumer.worker import Worker, WorkerSettings
from schemas import Reason, RouteHop, SessionSpec, Status, StepJob
from tests.doubles.null import NullEngine
from tests.memory_transport import MemoryTransport

WID = "w-unit"
_ids = itertools.count()


@pytest.fixture
def rig() -> tuple[Worker, MemoryTransport]:
    transport = MemoryTransport()
    worker = Worker(NullEngine(n_slots=4, vocab_size=32, token=7), transport,
                    WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0))
    worker.start()
    return worker, transport


def opening(w: Worker, sid: str, n: int = 3, max_tokens: int = 2, job_id: str | None = None) -> StepJob:
    key = w.keys["prefill"]
    spec = SessionSpec(session_id=sid, account_id="acct", route=(RouteHop(worker_id=WID, key=key),),
                       max_tokens=max_tokens)
    return StepJob(job_id=job_id or f"j{next(_ids)}", session_id=sid, phase="prefill", compat=key.digest,
                   start_position=0, tokens=tuple(range(1, n + 1)), created_at=1.0, session=spec)


def decode(w: Worker, sid: str, position: int, token: int) -> StepJob:
    return StepJob(job_id=f"j{next(_ids)}", session_id=sid, phase="decode", compat=w.keys["decode"].digest,
                   start_position=position, tokens=(token,), created_at=1.0)


def test_a_session_is_opened_decoded_and_finished(rig: tuple[Worker, MemoryTransport]) -> None:
    w, t = rig
    t.push(opening(w, "s1", n=3, max_tokens=2))
    assert w.run_once()
    (a,) = t.answers
    assert (a.result.status, a.result.token, a.result.position, a.close) == (Status.OK, 7, 3, None)
    assert a.account_id == "acct" and t.calls[-1].phase == "prefill"
    t.push(decode(w, "s1", 3, 7))
    w.run_once()
    b = t.answers[-1]
    assert (b.result.status, b.result.token, b.result.finished, b.close) == (Status.OK, 7, True, "finished")
    assert w.scheduler.table.busy_slots == 0


def test_a_job_delivered_twice_while_held_gets_the_same_answer_once_computed(
        rig: tuple[Worker, MemoryTransport]) -> None:
    w, t = rig
    job = opening(w, "s2")
    first, twin = t.push(job), t.push(job)
    w.run_once()
    assert [a.ref for a in t.answers] == [first, twin]
    assert t.answers[0].result == t.answers[1].result
    assert w.stats.fused_calls == 1 and w.scheduler.stats.admitted == 1


def test_a_refused_entry_naming_its_session_is_dead_lettered_and_answered(
        rig: tuple[Worker, MemoryTransport]) -> None:
    w, t = rig
    d = t.push_refused("prefill", Refusal(Reason.MALFORMED, "bad tokens", session_id="s3"))
    w.run_once()
    assert [(x.delivery, x.reason) for x in t.dead] == [(d, Reason.MALFORMED)]
    (a,) = t.answers
    assert a.ref is d and a.job is None and a.account_id is None
    assert (a.result.session_id, a.result.status, a.result.job_id) == ("s3", Status.REJECTED, f"prefill.{d.entry_id}")


def test_a_forged_entry_is_dead_lettered_and_never_answered(rig: tuple[Worker, MemoryTransport]) -> None:
    w, t = rig
    t.push_refused("decode", Refusal(Reason.BAD_SIGNATURE, "missing or wrong HMAC"))
    w.run_once()
    assert [x.reason for x in t.dead] == [Reason.BAD_SIGNATURE] and t.answers == []


def test_an_opening_with_a_cancel_marker_is_answered_cancelled_without_a_slot(
        rig: tuple[Worker, MemoryTransport]) -> None:
    w, t = rig
    t.cancel_markers.add("s4")
    t.push(opening(w, "s4"))
    w.run_once()
    (a,) = t.answers
    assert (a.result.status, a.close) == (Status.CANCELLED, "cancelled")
    assert w.scheduler.table.busy_slots == 0 and t.calls == []


def test_the_memory_transport_is_a_transport() -> None:
    t: Transport = MemoryTransport()  # checked by mypy when tests are type-checked; here: it constructs
    assert t.read({"decode": 1}) == []


def test_openings_refused_for_capacity_reach_dgr_inspect(rig: tuple[Worker, MemoryTransport]) -> None:
    """Issue 33: per worker, sessions refused for capacity, from the scheduler through the heartbeat to `dgr
    inspect --json`'s placement inputs."""
    from consumer.ops.inspect import _placement_inputs

    w, t = rig
    for i in range(4):  # every slot taken; the worker reads no more openings than it has slots for
        t.push(opening(w, f"cap-{i}", max_tokens=50))
    w.run_once()
    assert w.scheduler.table.busy_slots == 4
    # an opening admitted anyway (a read ahead, another lane's entry): refused, counted
    late = opening(w, "cap-late", max_tokens=50)
    a = w.scheduler.admit(late, late.compat, None)
    assert a is not None and a.result.reason == Reason.CAPACITY
    info = w._info()
    assert info["scheduler"]["rejected_capacity"] == 1  # type: ignore[index]
    assert _placement_inputs(json.loads(json.dumps(info)), {}, False)["refused_capacity"] == 1
