"""The scheduler's decode rows taken in one block (consumer/sched/output_processor.py, `inline_decode`) against the
general path it short-cuts (_claim, _take_token, _answer_ok, _result), the oracle: two schedulers driven alike
through random sessions of continuation jobs (stop tokens, max_tokens, cancellations before a call and while it
runs, logprobs, calls failed), every call's answers and the counters equal."""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batch import EngineOutput
from consumer.sampler import BatchSampler
from consumer.sched import Answer, ScheduledBatch, Scheduler
from schemas import Sampling, Status, StepJob
from schemas.step import split_result_id
from tests.test_scheduler import DIGESTS, admit, fake_logits, make, opening, report

VOCAB = 12
SOAK = os.environ.get("DGR_SOAK") == "1"


@dataclass(frozen=True)
class Plan:
    prompt: int
    max_tokens: int
    stop: tuple[int, ...]
    n: int  # tokens per continuation job
    cancel_at: int | None  # the call before which (or while which) it is cancelled
    in_flight: bool
    sampled: bool


plans = st.builds(Plan, prompt=st.integers(1, 6), max_tokens=st.integers(1, 12),
                  stop=st.sampled_from([(), (3,), (0, 5, 9)]), n=st.integers(1, 5),
                  cancel_at=st.none() | st.integers(0, 30), in_flight=st.booleans(), sampled=st.booleans())


def continuation(sid: str, start: int, n: int, k: int) -> StepJob:
    return StepJob(job_id=f"{sid}-c{k}", session_id=sid, phase="decode", compat=DIGESTS["decode"],
                   start_position=start, tokens=(), n=n, created_at=0.0)


def target(sid: str, pos: int) -> int:
    return (pos * 5 + sum(map(ord, sid))) % VOCAB


def drive(ps: list[Plan], slots: int, max_batch: int, fail_at: frozenset[int], inline: bool) -> list[Any]:
    """Every call's answers, and after it the scheduler's counters, its open sessions' entries and the sessions
    closed (with their tallies)."""
    s: Scheduler = make(n_slots=slots, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=max_batch,
                        prefill_budget=16)
    s.inline_decode = inline  # type: ignore[misc]
    jobs = itertools.count()
    for i, p in enumerate(ps):
        sid = f"s{i}"
        sampling = Sampling(temperature=1.0, seed=i) if p.sampled else Sampling()
        first = opening(sid, p.prompt, job_id=f"{sid}-open", max_tokens=p.max_tokens, stop=p.stop, sampling=sampling)
        if admit(s, first) is None:
            admit(s, continuation(sid, p.prompt, p.n, next(jobs)))
    out: list[Any] = []

    def after(answers: list[Answer]) -> tuple[Any, ...]:
        for a in answers:  # a decode token k of a job is answered at its start + k + 1, whichever path answers it
            r, job = a.result, a.job
            if job is not None and job.phase == "decode" and r.status == Status.OK and r.token is not None:
                assert r.position == job.start_position + split_result_id(r.job_id, job.job_id)[1] + 1, a
        entries = [dataclasses.astuple(e) for i in range(len(ps)) if (e := s.table.get(f"s{i}")) is not None]
        return answers, s.stats.as_dict(), entries, s.drain_closed()

    for t in range(200):
        answers: list[Answer] = []
        for i, p in enumerate(ps):
            if p.cancel_at == t and not p.in_flight:
                answers += s.cancel(f"s{i}")
        for slot in s.drain_released():
            s.slot_cleared(slot)
        b: ScheduledBatch | None = s.next_batch()
        if b is None:
            out.append(after(answers))
            break
        for i, p in enumerate(ps):
            if p.cancel_at == t and p.in_flight:
                answers += s.cancel(f"s{i}")
        if t in fail_at:
            got = s.fail(b, "injected")
        else:
            rows = sum(1 for it in b.items if it.samples)
            lps = [f"lp-{t}-{r}" for r in range(rows)] if t % 3 == 0 else None
            got = s.update_from_output(b, _tokens(b), 0.001 * len(b.fused), logprobs=lps)  # type: ignore[arg-type]
        answers += got
        for a in got:  # the Tracker's next continuation once a job's last token is in and the session goes on
            r = a.result
            if a.job is not None and a.job.phase == "decode" and r.status == Status.OK and a.final \
                    and not r.finished:
                admit(s, continuation(a.job.session_id, r.position, a.job.n, next(jobs)))
        out.append(after(answers))
    else:
        raise AssertionError("the scheduler still had work after 200 calls")
    return out


def _tokens(b: ScheduledBatch) -> list[int | None]:
    """What the worker's sampler draws from the call's rows (tests/test_scheduler.py `report`)."""
    return list(BatchSampler(VOCAB)(b, EngineOutput.logits(fake_logits(b, VOCAB, target))))


@settings(max_examples=2000 if SOAK else 150, deadline=None)
@given(st.lists(plans, min_size=1, max_size=7), st.integers(1, 6), st.integers(1, 6),
       st.frozensets(st.integers(0, 40), max_size=3))
def test_decode_rows_in_one_block_answer_as_the_general_path(ps: list[Plan], slots: int, max_batch: int,
                                                              fail_at: frozenset[int]) -> None:
    fast = drive(ps, slots, max_batch, fail_at, inline=True)
    general = drive(ps, slots, max_batch, fail_at, inline=False)
    assert len(fast) == len(general)
    for k, (a, b) in enumerate(zip(fast, general, strict=True)):
        assert a == b, f"call {k}"


def test_the_block_takes_the_common_row() -> None:
    """Not vacuous: a session decoding with nothing unusual goes through the block (its rows answered, the
    general path's _claim never asked)."""
    calls: list[int] = []
    s = make(n_slots=2, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=2, prefill_budget=16)
    claim = s._claim
    s._claim = lambda it: (calls.append(1), claim(it))[1]  # type: ignore[method-assign]
    assert admit(s, opening("a", 3, max_tokens=10)) is None
    assert admit(s, continuation("a", 3, 4, 0)) is None
    b = s.next_batch()
    assert b is not None and b.phase == "prefill"
    report(s, b, np.zeros((1, VOCAB), np.float32), 0.001)
    prefill_claims = len(calls)
    b = s.next_batch()
    assert b is not None and b.phase == "decode"
    got = report(s, b, np.zeros((1, VOCAB), np.float32), 0.001)
    assert [a.result.status for a in got] == [Status.OK] and len(calls) == prefill_claims
