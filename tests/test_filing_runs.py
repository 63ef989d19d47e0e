"""Runs of plain decode answers filed as whole columns (consumer/transport/publish.py `_runs`, `plain_run`) against
the definition, answer by answer: for any mix of answers a call's answers can hold (plain tokens of continuation
jobs to one or two Trackers' streams and accounts, a session's own stream, finished and rejected answers, log
probabilities, restored prompt positions, optional columns, answers already filed in the call, acks and their
deliveries, wire rejections), the completion call is the same, byte for byte."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched import Answer
from consumer.sched.outputs import Outcome
from consumer.transport.protocol import Closure, Delivery, Filing, FusedCallStats
from consumer.transport.publish import PLAIN_RUN, encode_filing
from schemas import Reason, Status, StepJob, TokenLogprobs, WorkerKeys

KEYS = WorkerKeys("w-runs")
HEAD = ["g", 60, 1000, 1000, 60, "tok", 1, 1000, 60, 1]


@st.composite
def answers(draw: st.DrawFn) -> list[Answer]:
    out: list[Answer] = []
    jobs: dict[str, tuple[StepJob, Delivery | None]] = {}
    # how mixed the call is: from every answer plain to one stream and account (the steady state) to anything
    kinds = ["plain"] * draw(st.sampled_from([1, 6, 60])) + ["finished", "rejected", "logprobs", "unbilled", "reply",
                                                                  "none"]
    replies = draw(st.sampled_from([["t1"], ["t1", "t1", "t2", None]]))
    accounts = draw(st.sampled_from([["a"], ["a", "a", "b"]]))
    for i in range(draw(st.integers(0, 3 * PLAIN_RUN))):
        sid = f"s{draw(st.integers(0, 12))}"  # sessions repeat: a second answer of one in a call
        if sid not in jobs or draw(st.booleans()):
            start, n = draw(st.integers(1, 300)), draw(st.sampled_from([1, 4, 16]))
            job = StepJob(job_id=f"{sid}-j{i}", session_id=sid, phase="decode", compat="d" * 16, start_position=start,
                          tokens=draw(st.sampled_from([(), (5,)])) if n == 1 else (), n=n, created_at=0.0,
                          attempt=draw(st.integers(0, 2)), reply_to=draw(st.sampled_from(replies)))
            ref = Delivery(f"in-{sid}", f"{i}-0", {}, "d" * 16, "decode") if draw(st.booleans()) else None
            jobs[sid] = (job, ref)
        job, ref = jobs[sid]
        off = draw(st.integers(0, job.n - 1))
        kind = draw(st.sampled_from(kinds))
        if kind == "none":  # a wire rejection: no job
            out.append(Answer(ref, None, Outcome(f"bad-{i}", sid, Status.REJECTED, Reason.MALFORMED, 0, "bad entry"),
                              None, None, reply=f"r-{sid}"))
            continue
        rid = job.job_id if off == 0 else f"{job.job_id}.{off}"
        status, reason = (Status.REJECTED, Reason.FINISHED) if kind == "rejected" else (Status.OK, None)
        # the position a decode token gets (its job's start + k + 1), or any: the filing reads the offset off the id
        position = draw(st.sampled_from([job.start_position + off + 1, draw(st.integers(1, 400))]))
        o = Outcome(rid, sid, status, reason, position, "",
                    None if kind == "rejected" else draw(st.integers(0, 1000)), kind == "finished",
                    draw(st.sampled_from([0, 0, 3])), draw(st.floats(0, 1)), 8, None,
                    TokenLogprobs(lp=-0.5) if kind == "logprobs" else None, draw(st.sampled_from([0, 0, 2])),
                    draw(st.sampled_from([0, 0, 0, 1])))
        out.append(Answer(ref, job, o, None if kind == "unbilled" else draw(st.sampled_from(accounts)),
                          "finished" if kind == "finished" else None, final=draw(st.booleans()),
                          reply="other" if kind == "reply" else ""))
    return out


def _encode(filing: Filing, fast: bool) -> Any:
    c = encode_filing(filing, KEYS, HEAD, worker_id="w-runs", call_id="1:1", consumer_name="c", fast_runs=fast)
    return c.keys, c.args, [(d.stream, d.entry_id) for d in c.settled]


@settings(max_examples=400, deadline=None)
@given(answers(), st.booleans())
def test_runs_of_plain_answers_file_as_answer_by_answer(got: list[Answer], closure: bool) -> None:
    filing = Filing(answers=got, closures=[Closure("s1", "a", "cancelled")] if closure else [],
                    call=FusedCallStats(phase="decode", batch_size=len(got), tokens=len(got), engine_seconds=0.01))
    assert _encode(filing, True) == _encode(filing, False)


def test_a_call_of_plain_tokens_is_filed_in_runs() -> None:
    """The steady state: every answer plain, one stream and one account: one run (the fast path is taken)."""
    from consumer.transport import publish

    jobs = [StepJob(job_id=f"s{i}-c", session_id=f"s{i}", phase="decode", compat="d" * 16, start_position=10, tokens=(),
                    n=16, created_at=0.0, reply_to="t") for i in range(32)]
    got = [Answer(None, j, Outcome(f"{j.job_id}.3", j.session_id, Status.OK, None, 14, "", 7, False, 0, 0.01, 32),
                  "a", None, final=False) for j in jobs]
    runs = list(publish._runs(got))
    assert [(plain, reply, len(run)) for plain, reply, run in runs] == [(True, "t", 32)]
    assert _encode(Filing(answers=got), True) == _encode(Filing(answers=got), False)


def test_a_call_of_interleaved_accounts_is_one_run() -> None:
    """One Tracker's sessions of several accounts, interleaved row by row (its callers' sessions decode in one call):
    still one run, each row billed to its own account, numbered in the control as answer by answer numbers them."""
    from consumer.transport import publish

    jobs = [StepJob(job_id=f"s{i}-c", session_id=f"s{i}", phase="decode", compat="d" * 16, start_position=10, tokens=(),
                    n=16, created_at=0.0, reply_to="t") for i in range(32)]
    got = [Answer(None, j, Outcome(f"{j.job_id}.3", j.session_id, Status.OK, None, 14, "", 7, False, 0, 0.01, 32),
                  f"a{i % 3}", None, final=False) for i, j in enumerate(jobs)]
    runs = list(publish._runs(got))
    assert [(plain, reply, len(run)) for plain, reply, run in runs] == [(True, "t", 32)]
    assert _encode(Filing(answers=got), True) == _encode(Filing(answers=got), False)
