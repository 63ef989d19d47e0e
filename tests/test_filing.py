"""The transport's one encoder (consumer/transport/publish.py `encode_filing`) searched for counterexamples: any
mix of answers (statuses, tokens or none, continuation offsets, optional columns set on some rows only, prefix
cache hits, answers to undecodable entries), acks and dead letters, over several result streams. The oracle
decodes the records it put in ARGV and reads every row back against the answer it came from; what it acks is
each final answer's delivery and each bare ack, once, never a dead-lettered one. No Redis: it is a pure function."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched.outputs import Answer, Outcome
from consumer.transport.protocol import DeadLetter, Delivery, Filing, FusedCallStats
from consumer.transport.publish import COMPLETE_ARGV, encode_filing
from schemas import Reason, Status, StepJob, WorkerKeys
from schemas.wire import OPTIONAL_COLUMNS, STATUS_CODE, ResultRecord, row_result_id

K = WorkerKeys("w-filing")
HEAD = list(range(len(COMPLETE_ARGV) - 1))  # the fixed ARGV before the control: values do not matter here
_RECORD = msgspec.json.Decoder(ResultRecord)


def delivery(i: int) -> Delivery:
    return Delivery(stream=f"in:{i % 2}", entry_id=f"{i}-0", fields={b"v": b"2"}, digest="d", phase="decode")


@st.composite
def answers(draw: st.DrawFn) -> tuple[list[Answer], list[DeadLetter], list[Delivery]]:
    out: list[Answer] = []
    for i in range(draw(st.integers(0, 12))):
        sid = f"s{draw(st.integers(0, 3))}"
        status = draw(st.sampled_from([Status.OK, Status.OK, Status.REJECTED, Status.CANCELLED, Status.FAILED]))
        n = draw(st.sampled_from([1, 1, 4]))
        job = None if draw(st.integers(0, 9)) == 0 else StepJob(
            job_id=f"j{i}", session_id=sid, phase="decode", compat="0" * 16, start_position=10 + i, tokens=(5,),
            created_at=1.0, n=n, reply_to=draw(st.sampled_from([None, "tracker-a", "tracker-b"])),
            attempt=draw(st.integers(0, 2)))
        off = draw(st.integers(0, n - 1)) if job is not None and status == Status.OK else 0
        rid = job.answer_id(off, status == Status.OK) if job is not None else f"entry-{i}"
        token = draw(st.none() | st.integers(0, 255)) if status == Status.OK else None
        o = Outcome(rid, sid, status, None if status == Status.OK else Reason.MALFORMED, 11 + i + off,
                    detail="" if status == Status.OK else "why", token=token, finished=draw(st.booleans()),
                    prompt_tokens=draw(st.integers(0, 9)), engine_seconds=draw(st.floats(0, 1)),
                    cached_tokens=draw(st.sampled_from([0, 0, 3])), prefill_calls=draw(st.sampled_from([0, 0, 1, 3])))
        out.append(Answer(ref=delivery(i), job=job, result=o, account_id=draw(st.sampled_from([None, "acct"])),
                          close=None, final=job is None or job.n == 1 or draw(st.booleans()),
                          reply="" if job is not None else f"r{i % 2}"))
    dead = [DeadLetter(delivery(100 + i), Reason.MALFORMED, "junk") for i in range(draw(st.integers(0, 2)))]
    bare = [delivery(200 + i) for i in range(draw(st.integers(0, 2)))]
    return out, dead, bare


@settings(max_examples=150, deadline=None)
@given(case=answers(), with_call=st.booleans())
def test_every_answer_is_its_row(case: tuple[list[Answer], list[DeadLetter], list[Delivery]], with_call: bool) -> None:
    got, dead, bare = case
    call = FusedCallStats("decode", 2, 3, 0.5) if with_call else None
    c = encode_filing(Filing(got, dead, acks=bare, call=call), K, HEAD, worker_id="w-filing", call_id="1:7",
                      consumer_name="w-filing")
    ctl: dict[str, Any] = msgspec.json.decode(c.args[len(HEAD)])
    by_reply: dict[str, list[Answer]] = {}
    for a in got:
        by_reply.setdefault(a.reply or (a.job.reply if a.job is not None else a.result.session_id), []).append(a)
    assert len(ctl["records"]) == len(by_reply)
    for rec_ctl, (reply, want) in zip(ctl["records"], by_reply.items(), strict=True):
        assert c.keys[rec_ctl["out"] - 1] == K.results(reply)
        rec = _RECORD.decode(c.args[rec_ctl["r"] - 1])
        assert (rec.worker_id, rec.call, rec.batch_size, len(rec)) == ("w-filing", "1:7", 2 if call else 0, len(want))
        for i, a in enumerate(want):
            o = a.result
            assert row_result_id(rec.job[i], rec.offset[i]) == o.job_id
            assert (rec.session_id[i], rec.status[i], rec.position[i], rec.token[i], rec.finished[i]) == \
                (o.session_id, STATUS_CODE[o.status], o.position, -1 if o.token is None else o.token, int(o.finished))
            assert (rec.fed_tokens[i], rec.engine_seconds[i]) == (o.prompt_tokens + o.cached_tokens, o.engine_seconds)
            assert rec.attempt[i] == (a.job.attempt if a.job is not None else 0)
            x = rec.extra.get(str(i))
            assert (x.detail if x else "") == o.detail
        for col in OPTIONAL_COLUMNS:  # present exactly when a row has a value, then one value per row
            values = [getattr(a.result, col) for a in want]
            assert getattr(rec, col) == (values if any(values) else msgspec.UNSET), col
    acked = [(c.keys[s - 1], i) for s, ids in ctl["acks"] for i in ids]
    dropped = {(d.delivery.stream, d.delivery.entry_id) for d in dead}
    expect = [(a.ref.stream, a.ref.entry_id) for a in got if a.final and isinstance(a.ref, Delivery)] + \
        [(d.stream, d.entry_id) for d in bare]
    assert sorted(acked) == sorted(e for e in expect if e not in dropped)
    assert ctl["nd"] == len(dead) and ("call" in ctl) == with_call
    assert {(d.stream, d.entry_id) for d in c.settled} == {e for e in expect if e not in dropped} | dropped
