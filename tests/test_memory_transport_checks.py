"""MemoryTransport.checks (tests/memory_transport.py) answers as the Redis transport's checks
(consumer/transport/upkeep.py): the same answers and closures filed through both `complete`s, the same
steps asked. Named cases with what each must answer, then random filings (hypothesis) compared step by
step, on fakeredis and on a real redis-server."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.sched import Answer, Outcome
from consumer.sched.outputs import AnswerClose
from consumer.transport import Closure, Filing, RedisTransport
from schemas import Reason, RouteHop, SessionSpec, Status, StepJob
from schemas.step import result_job_id
from tests.memory_transport import MemoryTransport
from tests.support import compat_key

WORKER = "wm"
ACCOUNT = "acct-m"
L = 4  # prompt length of every session
CloseKind = Literal["finished", "cancelled", "failed"]


def prefill(sid: str, start: int = 0, end: int = L, attempt: int = 0) -> StepJob:
    hop = RouteHop(worker_id=WORKER, key=compat_key("prefill"))
    spec = SessionSpec(session_id=sid, account_id=ACCOUNT, route=(hop,), max_tokens=64) if start == 0 else None
    return StepJob(job_id=f"{sid}-p{start}-{end}-a{attempt}", session_id=sid, phase="prefill",
                   compat=compat_key("prefill").digest, start_position=start, tokens=tuple(range(1, end - start + 1)),
                   created_at=time.time(), attempt=attempt, session=spec)


def decode(sid: str, start: int, n: int = 1, attempt: int = 0) -> StepJob:
    return StepJob(job_id=f"{sid}-d{start}-n{n}-a{attempt}", session_id=sid, phase="decode",
                   compat=compat_key("decode").digest, start_position=start, tokens=(100 + start,),
                   created_at=time.time(), attempt=attempt, n=n)


def ok(job: StepJob, off: int = 0, *, close: AnswerClose | None = None, account: str | None = ACCOUNT) -> Answer:
    """The job's token number `off` (decode) or its one answer (prefill), ok."""
    pos = job.start_position + off + 1 if job.phase == "decode" else job.end_position
    fed = 0 if job.phase == "decode" else len(job.tokens)
    o = Outcome(result_job_id(job.job_id, off), job.session_id, Status.OK, None, pos, token=200 + pos,
                finished=close == "finished", prompt_tokens=fed, engine_seconds=0.001)
    return Answer(ref=None, job=job, result=o, account_id=account, close=close,
                  final=job.n == 1 or off == job.n - 1 or close is not None)


def not_ok(job: StepJob, status: Status = Status.STATE_LOST, *, account: str | None = None,
           close: AnswerClose | None = None) -> Answer:
    """The job ended without a token (a step for a session this worker does not hold: no account)."""
    reason = {Status.STATE_LOST: Reason.UNKNOWN_SESSION, Status.CANCELLED: Reason.CANCELLED,
              Status.REJECTED: Reason.POSITION_GAP, Status.FAILED: Reason.ENGINE_ERROR}[status]
    o = Outcome(job.answer_id(0, False), job.session_id, status, reason, job.start_position)
    return Answer(ref=None, job=job, result=o, account_id=account, close=close)


class Both:
    """A RedisTransport and a MemoryTransport filed the same calls."""

    def __init__(self, client: redis.Redis) -> None:
        client.flushdb()
        self.redis = RedisTransport(client, WORKER, "c1")
        self.redis.register([compat_key("prefill"), compat_key("decode")], {"slots": 8})
        self.redis.acquire_lease()
        self.mem = MemoryTransport(WORKER)

    def file(self, answers: Sequence[Answer] = (), closures: Sequence[Closure] = ()) -> None:
        for t in (self.redis, self.mem):
            t.complete(Filing(list(answers), closures=list(closures)))

    def answered(self, steps: Sequence[StepJob]) -> set[str]:
        """The steps both call answered (asserted equal), by job id."""
        r, _ = self.redis.checks(steps, [s.session_id for s in steps])
        m, _ = self.mem.checks(steps, [s.session_id for s in steps])
        assert m == r, {"memory only": m - r, "redis only": r - m}
        return m


def test_named_cases_answer_as_the_redis_transport(redis_client: redis.Redis) -> None:
    b = Both(redis_client)
    # a single decode step answered ok; the session's next step is not
    p, d, d2 = prefill("one"), decode("one", L), decode("one", L + 1)
    b.file([ok(p), ok(d)])
    assert b.answered([p, d, d2]) == {p.job_id, d.job_id}

    # a continuation answered up to its last token (the session still open); one answered short of it is not
    c, c2 = decode("cont", L, n=3), decode("cont", L + 3, n=3)
    b.file([ok(prefill("cont")), *(ok(c, k) for k in range(3)), ok(c2, 0), ok(c2, 1)])
    assert b.answered([c, c2]) == {c.job_id}

    # a continuation that finished early (closed finished, in the answer): answered; closed cancelled: not
    fin, can = decode("fin", L, n=3), decode("can", L, n=3)
    b.file([ok(prefill("fin")), ok(fin, 0), ok(fin, 1, close="finished"),
            ok(prefill("can")), ok(can, 0)], closures=[Closure("can", "cancelled", ACCOUNT)])
    assert b.answered([fin, can]) == {fin.job_id}
    # a session closes once: a late answer finishing it leaves it closed cancelled
    b.file([ok(can, 1, close="finished")])
    assert b.answered([fin, can]) == {fin.job_id}
    # closed finished, but nothing of the continuation published: not answered
    nothing = decode("nothing", L, n=3)
    b.file([ok(prefill("nothing"), close="finished")])
    assert b.answered([nothing]) == set()

    # an older attempt's step after the newer attempt's answers (superseded: answered); the newer's next is not
    old, new = decode("att", L + 2, n=2, attempt=0), decode("att", L + 1, attempt=1)
    b.file([ok(prefill("att")), ok(decode("att", L), 0)])
    b.file([ok(prefill("att", 0, L + 1, attempt=1))])
    assert b.answered([old, new]) == {old.job_id}

    # a step answered not ok (its marker); with no account and no tally, position alone tells nothing
    lost, other = decode("lost", L + 5), decode("lost", L + 6)
    b.file([not_ok(lost)])
    assert b.answered([lost, other]) == {lost.job_id}

    # a continuation job ended not ok (its answer under `<job>.end`, StepJob.answer_id): answered, so a twin of it
    # that reaches a process which never held the session (after a crash) is not answered again (state_lost)
    ended, cont_next = decode("ended", L, n=2), decode("ended", L + 2, n=2)
    b.file([ok(prefill("ended"), close="finished"), not_ok(ended, Status.REJECTED, account=ACCOUNT)])
    assert b.answered([ended, cont_next]) == {ended.job_id}

    # a late answer (a step that was in the engine call when its session closed) goes into the closed session
    # hash, not a tally entry: the session stays closed, and its continuation counts from its first position
    late, ghost_next = decode("late", L + 1, n=3), decode("late", L + 2, n=3)
    b.file([ok(prefill("late")), ok(decode("late", L), close="finished")])
    b.file([ok(late, 0)])
    assert b.answered([late, ghost_next]) == {late.job_id}

    # a session closed failed and opened again by a newer attempt: what Redis answers (the newer attempt's
    # answers go into the closed session hash too; no tally entry comes back)
    again = decode("again", L, n=3, attempt=1)
    b.file([ok(prefill("again"))], closures=[Closure("again", "failed", ACCOUNT)])
    b.file([ok(prefill("again", attempt=1)), ok(again, 0)])
    b.answered([again, decode("again", L + 1, n=3, attempt=1)])

    # a closure alone (a cancel read for a session the worker never counted) creates nothing
    b.file(closures=[Closure("ghost", "cancelled", None)])
    assert b.answered([decode("ghost", 0)]) == set()


@dataclass(frozen=True)
class Op:
    kind: str  # "ok", "prefill", "not_ok", "close"
    attempt: int
    start: int
    n: int
    off: int
    account: bool
    close: str | None
    status: Status = Status.STATE_LOST


ops = st.builds(Op, kind=st.sampled_from(["ok", "ok", "ok", "prefill", "not_ok", "close"]),
                attempt=st.integers(0, 2), start=st.integers(0, 8), n=st.integers(1, 3), off=st.integers(0, 2),
                account=st.sampled_from([True, True, True, False]),
                close=st.sampled_from([None, None, None, "finished", "cancelled", "failed"]),
                status=st.sampled_from([Status.STATE_LOST, Status.CANCELLED, Status.REJECTED, Status.FAILED]))


def _job(sid: str, op: Op) -> StepJob:
    if op.kind == "prefill":
        return prefill(sid, op.start, op.start + op.n, attempt=op.attempt)
    return decode(sid, op.start, op.n, attempt=op.attempt)


def _filing(sid: str, batch: Sequence[Op]) -> tuple[list[Answer], list[Closure]]:
    answers: list[Answer] = []
    closures: list[Closure] = []
    for op in batch:
        acct = ACCOUNT if op.account else None
        by_answer: AnswerClose | None = op.close if op.close in ("finished", "cancelled") else None  # type: ignore[assignment]
        if op.kind == "close":
            closures.append(Closure(sid, op.close or "finished", acct))  # type: ignore[arg-type]
        elif op.kind == "not_ok":
            answers.append(not_ok(_job(sid, op), op.status, account=acct, close=by_answer))
        else:
            job = _job(sid, op)
            answers.append(ok(job, min(op.off, job.n - 1) if job.phase == "decode" else 0, close=by_answer,
                              account=acct))
    return answers, closures


def _candidates(sid: str) -> list[StepJob]:
    out = [decode(sid, s, n, a) for a in range(3) for s in range(10) for n in (1, 3)]
    return out + [prefill(sid, s, s + k, a) for a in range(3) for s in range(0, 8, 2) for k in (1, 2)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.lists(ops, min_size=1, max_size=4), min_size=1, max_size=8))
def test_random_filings_answer_as_the_redis_transport(redis_client: redis.Redis, calls: list[list[Op]]) -> None:
    """Any order of ok and not-ok answers (any attempt, position, account or none), closures of every kind
    (in an answer or alone), continuations answered anywhere: after every call both checks agree."""
    b = Both(redis_client)
    steps = _candidates("s") + _candidates("t")
    for i, batch in enumerate(calls):
        answers, closures = _filing("s" if i % 3 else "t", batch)
        b.file(answers, closures)
        b.answered(steps)


@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("kind", ["finished", "failed"])
def test_a_closed_continuation_is_answered_from_its_first_position(redis_client: redis.Redis, kind: CloseKind,
                                                                    apart: bool) -> None:
    """Closed (not cancelled) by a closure of its own (in the call of its first token, or alone in a later
    one: its tally entry folded) after its first token: answered; one whose first token was not: not."""
    b = Both(redis_client)
    c, untouched = decode("x", L, n=3), decode("x", L + 1, n=3)
    b.file([ok(prefill("x")), ok(c, 0)], closures=[] if apart else [Closure("x", kind, ACCOUNT)])
    if apart:
        assert b.answered([c, untouched]) == set()  # open: short of its last token
        b.file(closures=[Closure("x", kind, ACCOUNT)])
    assert b.answered([c, untouched]) == {c.job_id}
