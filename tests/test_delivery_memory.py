"""The delivery ledger's memory of answers (consumer/worker/delivery.py): `remembered(job)` answers as the
definition does (every kept answer under the job's result ids, whatever job it carries: a job id may be another
job's result id), through keeps, replacements, LRU evictions and re-sends, and the memory stays bounded."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched.outputs import Answer, Outcome
from consumer.worker.delivery import DeliveryLedger
from schemas import Status, StepJob
from schemas.step import end_job_id, result_job_id

JOB_IDS = ["j1", "j2", "j2.1", "j3"]  # "j2.1": a job id that is also another job's result id


def _job(jid: str, n: int) -> StepJob:
    return StepJob(job_id=jid, session_id="s" + jid.replace(".", "-"), phase="decode", compat="0123456789abcdef",
                   start_position=4, tokens=(1,), n=n, created_at=1.0)


def _ids(job: StepJob) -> list[str]:
    jid = job.job_id
    return [jid] if job.n == 1 else [*(result_job_id(jid, k) for k in range(job.n)), end_job_id(jid)]


op = st.one_of(
    st.tuples(st.just("job"), st.sampled_from(JOB_IDS), st.sampled_from([1, 3]), st.integers(0, 3)),
    st.tuples(st.just("jobless"), st.sampled_from([*JOB_IDS, "j1.2", "x"]), st.just(0), st.just(0)),
    st.tuples(st.just("ask"), st.sampled_from(JOB_IDS), st.sampled_from([1, 3]), st.just(0)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=40), memory=st.integers(1, 6))
def test_remembered_answers_as_the_definition(ops: list[tuple[str, str, int, int]], memory: int) -> None:
    ledger = DeliveryLedger(None, None, memory)  # type: ignore[arg-type]  # remember/remembered use neither
    for kind, jid, n, k in ops:
        if kind == "ask":
            job = _job(jid, n)
            want = [ledger.answered[r] for r in _ids(job) if r in ledger.answered]
            assert ledger.remembered(job) == want
            continue
        job: Any = _job(jid, n) if kind == "job" else None
        rid = jid if job is None else (end_job_id(jid) if k == 3 and n > 1 else result_job_id(jid, min(k, n - 1)))
        ledger.remember(Answer(None, job, Outcome(rid, "s", Status.OK, None, 5), "acct", None, final=True))
        assert len(ledger.answered) <= memory
    for jid in JOB_IDS:  # every job asked about at the end, both ways
        for n in (1, 3):
            job = _job(jid, n)
            assert ledger.remembered(job) == [ledger.answered[r] for r in _ids(job) if r in ledger.answered]
