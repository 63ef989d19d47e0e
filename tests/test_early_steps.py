"""consumer/worker/early.py: continuation jobs held for their session's prompt, bounded in count and time,
released by attempt."""

from __future__ import annotations

from consumer.transport.protocol import Delivery, Inbound
from consumer.worker.early import EarlySteps
from schemas import StepJob


def _held(sid: str, attempt: int, k: int = 0) -> Inbound:
    job = StepJob(job_id=f"{sid}-{attempt}-{k}", session_id=sid, phase="decode", compat="00000000000000dd",
                  start_position=5, tokens=(), n=4, attempt=attempt, created_at=0.0, with_opening=True)
    ref = Delivery(stream="in:decode", entry_id=f"{k}-{attempt}", fields={}, digest="00000000000000dd", phase="decode")
    return Inbound(ref=ref, phase="decode", digest=ref.digest, name=job.job_id, job=job)


def test_bounded_by_capacity_and_released_by_attempt_in_arrival_order() -> None:
    e = EarlySteps(capacity=3, hold_s=10.0)
    a0, a1, b0, c0 = _held("a", 0), _held("a", 1), _held("b", 0), _held("c", 0)
    assert e.hold("a", a0, 0.0) and e.hold("a", a1, 0.0) and e.hold("b", b0, 0.0)
    assert not e.hold("c", c0, 0.0) and len(e) == 3  # full: the caller admits it at once
    assert e.release_older("a", 1) == [a0] and len(e) == 2  # a newer attempt opens: the older goes first
    assert e.release("a", 0) == [] and e.release("a", 1) == [a1]
    assert e.release("b") == [b0] and len(e) == 0


def test_expired_after_hold_s_and_only_those() -> None:
    e = EarlySteps(capacity=8, hold_s=2.0)
    old, new = _held("o", 0), _held("n", 0)
    e.hold("o", old, 0.0)
    e.hold("n", new, 1.5)
    assert e.expired(1.9) == []
    assert e.expired(2.0) == [old] and len(e) == 1
    assert e.expired(3.5) == [new] and len(e) == 0


def test_a_coming_prompt_holds_past_hold_s_and_never_past_max_hold_s() -> None:
    e = EarlySteps(capacity=8, hold_s=2.0, max_hold_s=5.0)
    a, b = _held("a", 0), _held("b", 0)
    e.hold("a", a, 0.0)
    e.hold("b", b, 0.0)

    def coming(inb: Inbound, since: float) -> bool:
        return inb is a and since == 0.0

    assert e.expired(1.9, coming) == []
    assert e.expired(2.0, coming) == [b]  # its prompt is not coming: released at hold_s
    assert e.expired(4.9, coming) == [] and len(e) == 1
    assert e.expired(5.0, coming) == [a] and len(e) == 0  # coming or not, never past max_hold_s


def test_a_job_held_past_its_bound_is_reported_once() -> None:
    """EarlySteps.first_overdue: the first look at a job held past hold_s says so, every later one does not (the
    worker logs it once); the record stays bounded."""
    early = EarlySteps(capacity=4, hold_s=0.1)
    assert early.first_overdue("j1") and not early.first_overdue("j1") and early.first_overdue("j2")
    for k in range(5000):
        early.first_overdue(f"k{k}")
    assert len(early._said) <= 4096
