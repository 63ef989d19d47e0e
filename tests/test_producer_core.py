"""The producer's sans-I/O core on its own: no Redis, only the commands it queues and the handle it moves."""

from __future__ import annotations

import pytest

from producer.core import Batch, ProducerCore, SessionFailed, SessionHandle, WorkerInfo, job_id
from schemas import (
    Accounting,
    Reason,
    SessionSpec,
    Signer,
    Status,
    StepResult,
    WorkerKeys,
    job_from_fields,
    results_to_fields,
)
from tests.test_transport import WORKER, make_key, make_spec


def core(**kw: object) -> ProducerCore:
    c = ProducerCore(**kw)  # type: ignore[arg-type]
    c.remember(WorkerInfo(WORKER, [make_key("prefill"), make_key("decode")], {"vocab_size": 1000}, True, 0.0))
    return c


def answer(h: SessionHandle, jid: str, status: Status = Status.OK, token: int | None = None,
           finished: bool = False, reason: Reason | None = None) -> StepResult:
    return StepResult(job_id=jid, session_id=h.session_id, status=status, reason=reason, position=h.position,
                      token=token, finished=finished, accounting=Accounting(), worker_id=WORKER)


def xadds(b: Batch) -> list[tuple[str, dict[str, str]]]:
    return [(args[0], args[1]) for name, args, _ in b.ops if name == "xadd"]


def test_opening_is_chunked_with_the_record_and_prompt_len() -> None:
    c = core(prefill_chunk=4)
    h = c.new_handle(make_spec("s", max_tokens=5), list(range(1, 11)), 0)
    b = Batch()
    c.queue_prefill(b, h)
    jobs = [job_from_fields({k.encode(): v.encode() for k, v in f.items()}) for _, f in xadds(b)]
    assert [j.start_position for j in jobs] == [0, 4, 8] and [j.sample for j in jobs] == [False, False, True]
    assert jobs[0].session is not None and jobs[0].session.prompt_len == 10
    assert [op[0] for op in b.ops] == ["xadd"] * 3 + ["hset", "expire"]
    assert b.ops[3][1][0] == WorkerKeys(WORKER).session_record("s")
    assert h.jobs == {j.job_id for j in jobs} and h.pending_job == jobs[-1].job_id and h.position == 10


def test_results_drive_the_next_decode_and_old_attempts_are_ignored() -> None:
    c = core(prefill_chunk=8)
    h = c.new_handle(make_spec("s", max_tokens=2), [1, 2, 3], 0)
    c.queue_prefill(Batch(), h)
    assert not c.apply(h, answer(h, job_id("s", 0, "decode", 3, 0), token=9))  # not one of its jobs
    assert c.apply(h, answer(h, h.pending_job or "", token=7))
    b = Batch()
    assert c.advance(b, h, True)
    ((stream, fields),) = xadds(b)
    job = job_from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert stream == h.input_stream("decode") and job.tokens == (7,) and job.start_position == 3
    assert not c.advance(Batch(), h, True)  # one job in flight at most
    assert c.apply(h, answer(h, job.job_id, token=8, finished=True))
    assert h.finished and h.status == "finished" and h.generated == [7, 8]
    assert not c.advance(Batch(), h, True)


def test_state_lost_replays_prompt_plus_generated_or_ends_cancelled() -> None:
    c = core(prefill_chunk=8, max_attempts=1)
    h = c.new_handle(make_spec("s", max_tokens=4), [1, 2, 3], 0)
    c.queue_prefill(Batch(), h)
    c.apply(h, answer(h, h.pending_job or "", token=7))
    jid = c.queue_decode(Batch(), h, 7)
    c.apply(h, answer(h, jid, Status.STATE_LOST, reason=Reason.ENGINE_ERROR))
    assert h.status == "state_lost" and not h.finished and c.needs_cancel_check(h, True)
    assert not c.needs_cancel_check(h, False)
    marked = SessionHandle(**{**h.__dict__, "jobs": set(), "generated": list(h.generated)})
    assert not c.advance(Batch(), marked, True, cancel_marked=True)
    assert marked.finished and marked.status == "cancelled"
    b = Batch()
    assert c.advance(b, h, True)
    job = job_from_fields({k.encode(): v.encode() for k, v in xadds(b)[0][1].items()})
    assert job.attempt == 1 and job.tokens == (1, 2, 3, 7) and job.session is not None
    assert job.session.prompt_len == 3 and job.session.max_tokens == 3
    jid = h.pending_job or ""
    c.apply(h, answer(h, jid, Status.STATE_LOST, reason=Reason.ENGINE_ERROR))
    assert not c.advance(Batch(), h, True) and h.finished and h.status == "state_lost"  # attempts spent
    with pytest.raises(SessionFailed):
        c.queue_replay(Batch(), h, cancel_marked=False)


def test_unanswered_jobs_are_queued_again_with_the_same_ids() -> None:
    c = core(prefill_chunk=2)
    h = c.new_handle(make_spec("s", max_tokens=3), [1, 2, 3, 4, 5], 0)
    first = Batch()
    c.queue_prefill(first, h)
    c.apply(h, answer(h, job_id("s", 0, "prefill", 0, 0)))
    again = Batch()
    assert c.after_outage(again, [h]) == 2
    assert [job_from_fields(f).job_id for _, f in xadds(again)] == [job_from_fields(f).job_id for _, f in
                                                                      xadds(first)][1:]
    c.apply(h, answer(h, job_id("s", 0, "prefill", 2, 0)))
    c.apply(h, answer(h, job_id("s", 0, "prefill", 4, 0), token=11))
    dec = Batch()
    c.advance(dec, h, True)
    again = Batch()
    assert c.after_outage(again, [h]) == 1
    def ids(b: Batch) -> list[tuple[object, str, tuple[int, ...]]]:
        return [(st, j.job_id, j.tokens) for st, f in xadds(b) for j in [job_from_fields(f)]]

    assert ids(again) == ids(dec)  # created_at is the clock's


def test_backpressure_decisions_and_cancel_ops() -> None:
    c = core(max_lag=3, lag_cache_s=60, signer=Signer([b"k" * 32]))
    assert c.cached_lag("st") is None
    assert c.record_lag("st", 9, [{"name": b"dgr-workers", "lag": 2}]) == 2 and c.cached_lag("st") == 2
    assert c.record_lag("nx", RuntimeError("no such key"), RuntimeError("no such key")) == 0
    assert c.within_lag(3) and not c.within_lag(4)
    assert "for 1.5 s" in str(c.over_lag("st", 1.5))
    b = Batch()
    c.cancel_ops(b, WORKER, "s-1")
    keys = WorkerKeys(WORKER)
    assert [(n, a[0]) for n, a, _ in b.ops] == [("set", keys.cancel_marker("s-1")), ("xadd", keys.cancellations)]
    assert "sig" in b.ops[1][1][1]  # signed like every entry
    with pytest.raises(ValueError, match="worker_id"):
        c.cancel_ops(Batch(), "a}{b", "s-1")


def test_validation_needs_no_redis() -> None:
    c = core()
    with pytest.raises(ValueError, match="empty"):
        c.new_handle(make_spec("s"), [], 0)
    with pytest.raises(ValueError, match="outside"):
        c.new_handle(make_spec("s"), [1000], 0)  # the advertised vocabulary
    with pytest.raises(ValueError, match="advertise"):
        c.new_handle(make_spec("s", ctx=2048), [1], 0)
    assert c.route_worker_to_discover(make_spec("s"), 0) is None  # remembered just now
    assert core(discover_cache_s=-1).route_worker_to_discover(make_spec("s"), 0) == WORKER


def test_resume_follows_the_stream_through_a_replay() -> None:
    c = core(prefill_chunk=8)
    spec: SessionSpec = make_spec("s", max_tokens=3)
    h = c.new_handle(spec, [1, 2], 0)
    c.queue_prefill(Batch(), h)
    stream = [answer(h, h.pending_job or "", token=5)]
    c.apply(h, stream[-1])
    jid = c.queue_decode(Batch(), h, 5)
    stream.append(answer(h, jid, Status.STATE_LOST, reason=Reason.ENGINE_ERROR))
    record = {"spec": spec.model_dump_json(), "prompt": "1,2", "hop": "0", "attempt": "1"}
    r = c.resumer(WORKER, "s", record)
    r.feed([(f"{i + 1}-0", results_to_fields([x]))
            for i, x in enumerate(stream)])
    assert r.cursor is None
    rebuilt, again = r.finish()
    assert rebuilt.attempt == 1 and rebuilt.generated == [5] and rebuilt.last_result_id == "2-0"
    assert [job_from_fields({k.encode(): v.encode() for k, v in f.items()}).tokens for _, f in xadds(again)] == [
        (1, 2, 5)]
    with pytest.raises(LookupError):
        c.resumer(WORKER, "s", {})
