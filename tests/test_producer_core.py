"""The producer's sans-I/O core on its own: plans stepped by hand with the replies a test chooses, no Redis and no
client; what it asks for (typed commands) and how it moves the sessions."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from producer.commands import Batch, HGetAll, HSet, Read, Set, Sleep, XAdd, XInfoGroups, XLen, XRange, XRead
from producer.core import ProducerCore, Run
from producer.errors import Backpressure, SessionFailed
from producer.resume import resume
from producer.session import SessionHandle
from producer.steps import job_id
from producer.validate import WorkerInfo
from schemas import (
    Accounting,
    Reason,
    SessionSpec,
    Signer,
    Status,
    StepJob,
    StepResult,
    WireError,
    WorkerKeys,
    job_from_fields,
    results_to_fields,
)
from tests.test_transport import WORKER, make_key, make_spec

KEYS = WorkerKeys(WORKER)


def core(**kw: object) -> ProducerCore:
    c = ProducerCore(tracker_id="t-test", **kw)  # type: ignore[arg-type]
    c.remember(WorkerInfo(WORKER, [make_key("prefill"), make_key("decode")], {"vocab_size": 1000, "wire_version": 2},
                          True, 0.0))
    return c


def answer(h: SessionHandle, jid: str, status: Status = Status.OK, token: int | None = None,
           finished: bool = False, reason: Reason | None = None, position: int | None = None) -> StepResult:
    return StepResult(job_id=jid, session_id=h.session_id, status=status, reason=reason,
                      position=h.position if position is None else position, token=token, finished=finished,
                      accounting=Accounting(), worker_id=WORKER)


def jobs(b: Batch) -> list[StepJob]:
    return [job_from_fields(op.fields) for op in b.ops if isinstance(op, XAdd) and ":in:" in op.stream]


def run(plan: Any, answer_of: Callable[[Any], Any]) -> Any:
    """Step a plan to its end, each request answered by `answer_of` (a Batch's reply is None)."""
    reply = None
    try:
        while True:
            req = plan.send(reply)
            reply = None if isinstance(req, Batch | Sleep) else answer_of(req)
    except StopIteration as stop:
        return stop.value


def opened(c: ProducerCore, sid: str = "s", prompt: tuple[int, ...] = (1, 2, 3), max_tokens: int = 2) -> SessionHandle:
    h = c.new_handle(make_spec(sid, max_tokens=max_tokens), prompt)
    c.queue_prefill(Batch(), h)
    return h


def test_opening_is_chunked_with_the_record_and_prompt_len() -> None:
    c = core(prefill_chunk=4)
    h = c.new_handle(make_spec("s", max_tokens=5), list(range(1, 11)))
    b = Batch()
    c.queue_prefill(b, h)
    js = jobs(b)
    assert [j.start_position for j in js] == [0, 4, 8] and [j.sample for j in js] == [False, False, True]
    assert js[0].session is not None and js[0].session.prompt_len == 10
    assert all(j.reply_to == "t-test" for j in js)  # every answer goes to this Tracker's one stream
    assert [type(op) for op in b.ops] == [XAdd] * 3 + [HSet, type(b.ops[-1])]
    record = b.ops[3]
    assert isinstance(record, HSet) and record.key == KEYS.session_record("s")
    assert record.mapping["reply"] == "t-test" and json.loads(record.mapping["from"]) == {WORKER: "0-0"}
    assert h.jobs == {j.job_id for j in js} and h.pending_job == js[-1].job_id and h.position == 10


def test_results_drive_the_next_decode_and_old_attempts_are_ignored() -> None:
    c = core(prefill_chunk=8, decode_n=1)
    h = opened(c)
    assert not c.apply(h, answer(h, job_id("s", 0, "decode", 3, 0), token=9))  # not one of its jobs
    assert c.apply(h, answer(h, h.pending_job or "", token=7))
    b = Batch()
    assert c.advance(b, h, True)
    (job,) = jobs(b)
    assert job.tokens == (7,) and job.start_position == 3 and job.n == 1
    assert not c.advance(Batch(), h, True)  # one job in flight at most
    assert c.apply(h, answer(h, job.job_id, token=8, finished=True))
    assert h.finished and h.status == "finished" and h.generated == [7, 8]
    assert not c.advance(Batch(), h, True)


def test_state_lost_replays_prompt_plus_generated_or_ends_cancelled() -> None:
    # regenerate=False: the tokens re-fed as prompt (tests/test_replay_regenerate.py: sampled again)
    c = core(prefill_chunk=8, max_attempts=1, decode_n=1, regenerate=False)
    h = opened(c, max_tokens=4)
    c.apply(h, answer(h, h.pending_job or "", token=7))
    jid = c.queue_decode(Batch(), h, 7)
    c.apply(h, answer(h, jid, Status.STATE_LOST, reason=Reason.ENGINE_ERROR))
    assert h.status == "state_lost" and not h.finished and h.awaits_replay
    marked = SessionHandle(**{**h.__dict__, "sent": {}, "generated": list(h.generated)})
    assert not c.advance(Batch(), marked, True, cancel_marked=True)
    assert marked.finished and marked.status == "cancelled"
    b = Batch()
    assert c.advance(b, h, True)
    (job,) = jobs(b)
    assert job.attempt == 1 and job.tokens == (1, 2, 3, 7) and job.session is not None
    assert job.session.prompt_len == 3 and job.session.max_tokens == 3
    c.apply(h, answer(h, h.pending_job or "", Status.STATE_LOST, reason=Reason.ENGINE_ERROR))
    assert not c.advance(Batch(), h, True) and h.finished and h.status == "state_lost"  # attempts spent
    with pytest.raises(SessionFailed):
        c.queue_replay(Batch(), h, cancel_marked=False)


def test_unanswered_jobs_are_queued_again_with_the_same_ids() -> None:
    c = core(prefill_chunk=2, decode_n=1)
    h = c.new_handle(make_spec("s", max_tokens=3), [1, 2, 3, 4, 5])
    first = Batch()
    c.queue_prefill(first, h)
    c.apply(h, answer(h, job_id("s", 0, "prefill", 0, 0)))
    again = Batch()
    assert c.queue_unanswered(again, h) == 2
    assert [j.job_id for j in jobs(again)] == [j.job_id for j in jobs(first)][1:]
    c.apply(h, answer(h, job_id("s", 0, "prefill", 2, 0)))
    c.apply(h, answer(h, job_id("s", 0, "prefill", 4, 0), token=11))
    dec = Batch()
    c.advance(dec, h, True)
    again = Batch()
    assert c.queue_unanswered(again, h) == 1
    assert [(j.job_id, j.tokens) for j in jobs(again)] == [(j.job_id, j.tokens) for j in jobs(dec)]


def test_continuation_tokens_are_placed_by_position_and_answered_once() -> None:
    c = core(prefill_chunk=8)
    c.remember(WorkerInfo(WORKER, [make_key("prefill"), make_key("decode")], {"max_continuation": 4}, True, 0.0))
    h = opened(c, max_tokens=9)
    assert h.credit.n == 4
    c.apply(h, answer(h, h.pending_job or "", token=10, position=3))
    b = Batch()
    assert c.advance(b, h, True)
    (a,) = jobs(b)
    assert (a.n, a.tokens, a.start_position) == (4, (10,), 3)
    for k, pos in ((1, 5), (0, 4)):  # token 1 arrives ahead of token 0: held until 0 is in place
        assert c.apply(h, answer(h, f"{a.job_id}.{k}" if k else a.job_id, token=20 + k, position=pos))
    assert h.generated == [10, 20, 21]
    assert not c.apply(h, answer(h, f"{a.job_id}.1", token=21, position=5))  # re-sent: changes nothing
    b = Batch()
    assert c.advance(b, h, True)  # two of four left: the next job is pushed ahead, with no token
    (nxt,) = jobs(b)
    assert (nxt.tokens, nxt.start_position, nxt.n) == ((), 7, 4)
    assert c.apply(h, answer(h, f"{nxt.job_id}.end", Status.CANCELLED, reason=Reason.CANCELLED))
    assert h.finished and h.status == "cancelled" and not h.sent and not h.credit.jobs


def test_backpressure_is_a_plan_and_the_lag_is_cached() -> None:
    c = core(max_lag=3, lag_cache_s=60)
    asked: list[Any] = []

    def lag(n: int) -> Callable[[Any], Any]:
        def answer_of(req: Any) -> Any:
            asked.append(req)
            assert req == Read((XLen("st"), XInfoGroups("st")), errors=True)
            return [9, [{"name": b"dgr-workers", "lag": n}]]
        return answer_of

    assert run(c.admit("st", wait=True), lag(2)) is True
    assert run(c.admit("st", wait=True), lag(99)) is True and len(asked) == 1  # cached
    c.lag.clear()
    with pytest.raises(Backpressure, match="max_lag=3"):
        run(c.admit("st", wait=True), lag(4))
    c.lag.clear()
    assert run(c.admit("nx", wait=False), lambda _: [RuntimeError("no such key")] * 2) is True  # no stream yet
    waits = core(max_lag=3, lag_cache_s=0, backpressure="wait", timeout_s=0.05)
    with pytest.raises(Backpressure, match=r"for 0\.05 s"):
        run(waits.admit("st", wait=True), lambda _: [9, [{"name": b"dgr-workers", "lag": 5}]])


def test_cancel_is_signed_and_ids_are_checked_first() -> None:
    c = core(signer=Signer([b"k" * 32]))
    (b,) = list(c.cancel_batches([WORKER], "s-1"))
    assert b.transaction and b.tag == WORKER
    assert [(type(op), op[0]) for op in b.ops] == [(Set, KEYS.cancel_marker("s-1")), (XAdd, KEYS.cancellations)]
    assert "sig" in b.ops[1][1]  # signed like every entry
    with pytest.raises(ValueError, match="worker_id"):
        c.cancel_batches(["a}{b"], "s-1")


def test_validation_needs_no_redis_and_another_wire_version_is_refused_by_name() -> None:
    c = core()
    with pytest.raises(ValueError, match="empty"):
        c.new_handle(make_spec("s"), [])
    with pytest.raises(ValueError, match="outside"):
        c.new_handle(make_spec("s"), [1000])  # the advertised vocabulary
    with pytest.raises(ValueError, match="advertise"):
        c.new_handle(make_spec("s", ctx=2048), [1])
    assert c.to_discover(make_spec("s")) == []  # remembered just now
    assert core(discover_cache_s=-1).to_discover(make_spec("s")) == [WORKER]
    spec = '{"keys": [], "info": {"wire_version": 1}}'
    with pytest.raises(WireError, match="wire version 1") as e:
        run(c.discover(WORKER), lambda req: [spec, None, -2])
    assert e.value.reason == Reason.SCHEMA_VERSION


def _record(rows: list[StepResult], not_published: list[int]) -> dict[bytes, bytes]:
    fields = results_to_fields(rows)
    chg = msgspec.json.decode(fields[b"c"])
    chg["d"] = not_published
    fields[b"c"] = msgspec.json.encode(chg)
    return fields


def test_a_read_is_one_xread_on_the_trackers_stream_and_applies_records_once() -> None:
    c = core(prefill_chunk=8, decode_n=1)
    h = c.new_handle(make_spec("s", max_tokens=3), (1, 2, 3))
    r = Run([], [])
    c.queue_prefill(Batch(), h)
    c.drive(h, r)
    stream = KEYS.results("t-test")
    got = answer(h, h.pending_job or "", token=7)
    twin = answer(h, h.pending_job or "", token=99)  # a row the worker did not publish (c.d): skipped
    entries = [("5-0", _record([twin, got], [0])), ("6-0", {b"v": b"1", b"r": b"{}", b"c": b"{}"})]
    requests: list[Any] = []

    def answer_of(req: Any) -> Any:
        requests.append(req)
        return [[(stream, entries)]]

    touched = run(c.turn(500), answer_of)
    assert requests == [Read((XRead(((stream, "0-0"),), 1000, 500),))]
    assert touched == [h] and h.generated == [7] and c.cursors[stream] == "6-0"
    assert c.refused == 1  # another wire version: counted (and logged), never applied
    assert h.last_result_id == "5-0" and h.last_result is not None and h.last_result.token == 7
    assert len(h.sent) == 1  # the next decode job was pushed in the same turn
    c.outage = True  # Redis answered again after an outage: re-read from a little earlier, re-push
    plan = c.turn(0)
    again = plan.send(None)
    assert isinstance(again, Batch) and [j.job_id for j in jobs(again)] == list(h.sent)
    assert plan.send(None) == Read((XRead(((stream, "0-0"),), 1000, None),))  # 6 ms - rewind_ms: from the start


def test_resume_rebuilds_a_session_from_its_record_and_its_answers() -> None:
    c = core(prefill_chunk=8, decode_n=1)
    spec: SessionSpec = make_spec("s", max_tokens=4)
    h = c.new_handle(spec, [1, 2])
    c.queue_prefill(Batch(), h)
    stream = [answer(h, h.pending_job or "", token=5)]
    c.apply(h, stream[-1])
    jid = c.queue_decode(Batch(), h, 5)
    stream.append(answer(h, jid, token=6))
    record = {"spec": spec.model_dump_json(), "prompt": "1,2", "hop": "0", "attempt": "0", "decode_n": "1",
              "reply": "t-old", "gen": "", "from": "{}"}
    other = core(prefill_chunk=8, decode_n=1)
    asked: list[Any] = []

    def answer_of(req: Any) -> Any:
        asked.append(req)
        if isinstance(req.cmds[0], HGetAll):
            return [record]
        return [[(f"{i + 1}-0", results_to_fields([x])) for i, x in enumerate(stream)]]

    (rebuilt,) = run(resume(other, WORKER, ["s"]), answer_of).values()
    assert asked[1] == Read((XRange(KEYS.results("t-old"), "-", 1000),))  # the stream its record names
    assert rebuilt.generated == [5, 6] and rebuilt.position == 4 and rebuilt.reply == "t-old"
    assert rebuilt.last_result_id == "2-0" and [s.job.tokens for s in rebuilt.sent.values()] == [(6,)]
    assert other.cursors[KEYS.results("t-old")] == "2-0"
    with pytest.raises(LookupError):
        run(resume(other, WORKER, ["x"]), lambda req: [{}])


def test_recent_cancels_are_sent_again_after_an_outage() -> None:
    """A failover can lose the writes of its last moments: a cancel among them would let the session run on."""
    c = core(rewind_ms=60_000)
    plan = c.cancel(WORKER, "s-1")
    req = plan.send(None)
    assert isinstance(req, Batch) and req.transaction
    with pytest.raises(StopIteration):
        plan.send(None)
    c.outage = True
    again = next(c.recover())
    assert [op[0] for op in again.ops] == [KEYS.cancel_marker("s-1"), KEYS.cancellations]
    old = core(rewind_ms=0)
    run(old.cancel(WORKER, "s-2"), lambda _: None)
    old.outage = True
    assert list(old.recover()) == []  # older than rewind_ms: not sent again
