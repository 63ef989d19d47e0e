"""Scheduler.supersede and the attempt rule (pure, no Redis): a newer attempt's opening drops the older
attempt a worker still holds (a route replays every hop after a lost state on any one), while an older
or equal attempt, a cancelled session, and a session with a call in flight are left as they are; steps
of a dropped attempt are never computed. Hypothesis searches the orderings."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched import Scheduler
from schemas import Reason, Status, StepJob
from tests.test_scheduler import DIGESTS, decode, make, opening, run

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches


def replace(job: StepJob, **kw: object) -> StepJob:
    """The job with fields changed, validated again."""
    return job.replace(**kw)


def _open(s: Scheduler, sid: str, attempt: int, n: int = 4, **kw: object) -> StepJob:
    return replace(opening(sid, n, job_id=f"{sid}.p0.a{attempt}", **kw), attempt=attempt)  # type: ignore[arg-type]


def _admit_all(s: Scheduler, job: StepJob) -> list:
    out = list(s.supersede(job, DIGESTS[job.phase]))
    a = s.admit(job, DIGESTS[job.phase], ref=job.job_id)
    return out + ([a] if a is not None else [])


def _decode_a(sid: str, pos: int, attempt: int) -> StepJob:
    return replace(decode(sid, pos, job_id=f"{sid}.d{pos}.a{attempt}"), attempt=attempt)


def test_a_newer_attempt_reopens_an_open_session() -> None:
    s = make()
    assert _admit_all(s, _open(s, "s", 0)) == []
    run(s, s.next_batch())  # the opening ran: the session is DECODING at position 4
    assert _admit_all(s, _decode_a("s", 4, 0)) == []  # queued, not yet run
    answers = _admit_all(s, _open(s, "s", 1, n=6))
    # the old attempt's queued step is answered (superseded), the new opening is queued
    assert [(a.result.status, a.result.reason) for a in answers] == [(Status.REJECTED, Reason.ALREADY_OPEN)]
    assert "superseded" in answers[0].result.detail
    assert s.table.get("s") is not None and s.table.get("s").opening_job_id == "s.p0.a1"
    assert s.drain_closed() == []  # no accounting closure: the session goes on
    out = run(s, s.next_batch())
    assert [a.result.position for a in out if a.result.status == Status.OK] == [6]
    # a late step of the dropped attempt is never computed
    (late,) = _admit_all(s, _decode_a("s", 6, 0))
    assert (late.result.status, late.result.reason) == (Status.REJECTED, Reason.DUPLICATE)


def test_a_step_of_an_attempt_not_opened_here_is_never_computed_on_the_held_one() -> None:
    """A replay's first continuation read (and held past early_hold_s) before its new opening, or a forger's
    step under a newer attempt: the worker holds attempt 0 at that very position, yet the step is not one of
    attempt 0's. Answered state_lost (the Tracker replays the attempt it named), the held attempt untouched."""
    s = make()
    _admit_all(s, _open(s, "s", 0))
    run(s, s.next_batch())  # attempt 0 is DECODING at position 4
    (r,) = _admit_all(s, _decode_a("s", 4, 1))
    assert (r.result.status, r.result.reason) == (Status.STATE_LOST, Reason.UNKNOWN_SESSION)
    assert "attempt 0" in r.result.detail and s.queued("decode") == 0
    assert _admit_all(s, _decode_a("s", 4, 0)) == []  # attempt 0 goes on
    assert [a.result.position for a in run(s, s.next_batch()) if a.result.status == Status.OK] == [5]


def test_equal_or_older_attempt_and_cancelled_sessions_are_not_reopened() -> None:
    s = make()
    _admit_all(s, _open(s, "s", 2))
    for a in (0, 1):  # an older attempt's opening: never computed
        (r,) = _admit_all(s, _open(s, "s", a))
        assert r.result.reason == Reason.DUPLICATE and s.table.get("s").opening_job_id == "s.p0.a2"
    (dup,) = _admit_all(s, _open(s, "s", 2))  # the same opening again
    assert dup.result.reason == Reason.DUPLICATE
    (other,) = _admit_all(s, replace(_open(s, "s", 2), job_id="another"))  # the same attempt, another job
    assert other.result.reason == Reason.ALREADY_OPEN
    s.cancel("s")
    (c,) = _admit_all(s, _open(s, "s", 3))
    assert c.result.status == Status.CANCELLED  # a cancel is final


def test_a_call_in_flight_is_never_superseded() -> None:
    s = make()
    _admit_all(s, _open(s, "s", 0))
    batch = s.next_batch()
    assert batch is not None
    (r,) = _admit_all(s, _open(s, "s", 1))
    assert r.result.reason == Reason.ALREADY_OPEN  # the Tracker retries it; the engine's call is untouched
    run(s, batch)
    assert _admit_all(s, replace(_open(s, "s", 1), job_id="s.p0.a1-again")) == []


def test_a_finished_session_reopens_on_a_newer_attempt() -> None:
    s = make()
    _admit_all(s, _open(s, "s", 0, max_tokens=1))
    out = run(s, s.next_batch())
    assert out[-1].result.finished
    assert _admit_all(s, _open(s, "s", 1, max_tokens=1)) == []
    assert s.table.get("s") is not None


@settings(max_examples=1000 if SOAK else 60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "decode", "run", "cancel"]), st.integers(0, 3)),
                min_size=1, max_size=25))
def test_every_admitted_step_is_answered_once_and_slots_balance(ops: list[tuple[str, int]]) -> None:
    """Random interleavings of openings of any attempt, decode steps of any attempt, calls and cancels:
    every admitted job gets exactly one answer, no slot leaks, and the session is held at the highest
    attempt admitted since its last cancel."""
    s = make(n_slots=2)
    admitted: set[str] = set()
    answered: list[str] = []
    pos = 0
    top = -1  # the highest attempt whose opening was admitted

    def take(answers: list) -> None:
        answered.extend(a.result.job_id for a in answers)

    for i, (op, attempt) in enumerate(ops):
        if op == "open":
            job = replace(_open(s, "s", attempt), job_id=f"o{i}.a{attempt}")
            out = _admit_all(s, job)
            take(out)
            if job.job_id not in {a.result.job_id for a in out}:
                admitted.add(job.job_id)
                assert attempt >= top, "an older attempt was admitted"
                top = attempt
        elif op == "decode":
            entry = s.table.get("s")
            p = entry.queued_position if entry is not None else pos
            job = replace(_decode_a("s", p, attempt), job_id=f"d{i}.a{attempt}")
            out = _admit_all(s, job)
            take(out)
            if job.job_id not in {a.result.job_id for a in out}:
                admitted.add(job.job_id)
        elif op == "run":
            b = s.next_batch()
            if b is not None:
                take(run(s, b))
        else:
            take(s.cancel("s"))
        for slot in s.drain_released():
            s.slot_cleared(slot)
        entry = s.table.get("s")
        if entry is not None:
            assert entry.opening_job_id.endswith(f".a{top}")
    while (b := s.next_batch()) is not None:
        take(run(s, b))
    take(s.cancel("s"))
    for slot in s.drain_released():
        s.slot_cleared(slot)
    assert sorted(j for j in answered if j in admitted) == sorted(admitted)
    assert len([j for j in answered if j in admitted]) == len(admitted)  # once each
    assert s.table.busy_slots == 0
