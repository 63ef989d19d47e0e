"""The worker's read while the engine computes (`Transport.read_ahead`): its input entries and the cancellations
since the last read in ONE round trip, the same entries and cancellations the two reads gave one after the other
(`read_streams` without blocking, then `cancellations`), on fakeredis and a real redis-server."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.transport import RedisTransport
from schemas import GROUP, Reason, job_from_fields
from schemas.wire import cancel_to_fields
from tests.test_transport import WORKER, counting, make_job, make_key, push, streams_of


def registered(client: redis.Redis, consumer: str = "c1") -> RedisTransport:
    t = RedisTransport(client, WORKER, consumer)
    t.register([make_key("prefill"), make_key("decode")], {"slots": 64})
    return t


def sessions(ds: list) -> list[str]:
    return [job_from_fields(d.fields).session_id for d in ds]


def cancel(client: redis.Redis, t: RedisTransport, *session_ids: str) -> None:
    for sid in session_ids:
        client.xadd(t.keys.cancellations, cancel_to_fields(sid))  # type: ignore[arg-type]


def test_one_round_trip_for_the_entries_and_the_cancellations(redis_client: redis.Redis) -> None:
    t = registered(redis_client)
    pre, dec = streams_of(t)
    t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)  # the first read re-reads own pending entries
    push(redis_client, dec, [make_job(f"d{i}", 1) for i in range(5)])
    push(redis_client, pre, [make_job(f"p{i}", 0, phase="prefill") for i in range(3)])
    cancel(redis_client, t, "c1", "c2")
    with counting(redis_client) as c:
        got, cancels, refused = t.read_ahead({dec: 3, pre: 3})
    assert c.calls == ["PIPELINE[XREAD,XREADGROUP]"]  # equal counts: one XREADGROUP of both streams
    assert sorted(sessions(got)) == ["d0", "d1", "d2", "p0", "p1", "p2"]
    assert {d.phase for d in got if d.stream == dec} == {"decode"} and cancels == ["c1", "c2"] and refused == []
    with counting(redis_client) as c:
        got, cancels, refused = t.read_ahead({dec: 4, pre: 1})  # two counts: two XREADGROUPs
    assert c.calls == ["PIPELINE[XREAD,XREADGROUP,XREADGROUP]"]
    assert sessions(got) == ["d3", "d4"] and cancels == [] and refused == []  # each cancellation read once
    cancel(redis_client, t, "c3")
    got, cancels, _ = t.read_ahead({dec: 4})
    assert got == [] and cancels == ["c3"]
    assert len(t.intake.outstanding[dec]) == 5 and len(t.intake.outstanding[pre]) == 3  # held until acked


def test_the_same_as_the_two_reads(redis_client: redis.Redis) -> None:
    """Two workers fed the same entries and cancellations, one reading ahead, the other reading twice."""
    ahead, twice = registered(redis_client), RedisTransport(redis_client, "w2", "c1")
    twice.register([make_key("prefill"), make_key("decode")], {"slots": 64})
    decodes = [make_job(f"d{i}", 1) for i in range(7)]
    prefills = [make_job(f"p{i}", 0, phase="prefill") for i in range(2)]
    for t in (ahead, twice):
        pre, dec = streams_of(t)
        t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)
        push(redis_client, dec, decodes)
        push(redis_client, pre, prefills)
        cancel(redis_client, t, "x", "y")
        redis_client.xadd(t.keys.cancellations, {"junk": "1"})  # not a cancellation: a dead letter
    refusals = []
    for want in ((3, 5), (0, 2), (9, 9)):
        pre, dec = streams_of(ahead)
        got, cancels, refused = ahead.read_ahead({dec: want[0], pre: want[1]})
        pre2, dec2 = streams_of(twice)
        got2 = twice.read_streams({dec2: want[0], pre2: want[1]}, block_ms=0, gather_ms=0)
        cancels2, refused2 = twice.cancellations()
        assert [(d.phase, d.fields) for d in got] == [(d.phase, d.fields) for d in got2]
        assert cancels == cancels2
        assert [(r.reason, r.delivery.fields) for r in refused] == [(r.reason, r.delivery.fields) for r in refused2]
        refusals += refused
    assert [r.reason for r in refusals] == [Reason.MALFORMED]  # the junk entry, once


def test_after_a_start_its_own_pending_entries_come_first(redis_client: redis.Redis) -> None:
    """Before every stream's pending entries are re-read, read_ahead reads as read_streams does (the re-read)."""
    first = registered(redis_client)
    _pre, dec = streams_of(first)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(4)])
    held = first.read_streams({dec: 2}, block_ms=0)  # the process dies holding two
    again = registered(redis_client)  # restarted, the same consumer name
    cancel(redis_client, again, "gone")
    got, cancels, _ = again.read_ahead({dec: 2})
    assert [d.entry_id for d in got] == [d.entry_id for d in held] and cancels == ["gone"]
    got, _, _ = again.read_ahead({dec: 5})
    got += again.read_ahead({dec: 5})[0]
    assert sessions(got) == ["s2", "s3"]


def test_a_lost_group_is_made_again_and_read_next_time(redis_client: redis.Redis) -> None:
    t = registered(redis_client)
    pre, dec = streams_of(t)
    t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)
    redis_client.delete(dec)  # the stream and its group gone (a FLUSHALL, a Redis restarted without its data)
    cancel(redis_client, t, "c9")
    got, cancels, _ = t.read_ahead({dec: 2, pre: 1})
    assert got == [] and cancels == ["c9"]
    assert any(g["name"] == GROUP.encode() for g in redis_client.xinfo_groups(dec))  # type: ignore[union-attr]
    push(redis_client, dec, [make_job("after", 1)])
    got, _, _ = t.read_ahead({dec: 2, pre: 1})
    assert sessions(got) == ["after"]


def test_a_failed_cancel_read_leaves_the_read_entries_to_recovery(real_redis: redis.Redis) -> None:
    """The cancel stream's read fails (its key overwritten with another type): the error is raised, and the entries
    the same pipeline read are not taken as held, so recovery hands them out again; none is lost. (Real Redis
    only: fakeredis raises its own AttributeError on that XREAD.)"""
    redis_client = real_redis
    t = registered(redis_client)
    pre, dec = streams_of(t)
    t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)
    push(redis_client, dec, [make_job(f"r{i}", 1) for i in range(3)])
    redis_client.delete(t.keys.cancellations)
    redis_client.set(t.keys.cancellations, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        t.read_ahead({dec: 3, pre: 1})
    assert not t.intake.outstanding.get(dec)
    again = t.recover()
    assert sorted(job_from_fields(i.ref.fields).session_id for i in again) == ["r0", "r1", "r2"]


_examples = itertools.count()
_op = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(["decode", "prefill"]), st.integers(0, 6)),
    st.tuples(st.just("cancel"), st.sampled_from(["ok", "junk", "bytes"]), st.integers(1, 3)),
    st.tuples(st.just("read"), st.integers(0, 9), st.integers(0, 9)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, min_size=1, max_size=14))
def test_any_run_of_pushes_cancels_and_reads_reads_what_the_two_reads_read(redis_client: redis.Redis,
                                                                            ops: list[tuple[str, Any, int]]) -> None:
    """Drawn runs of jobs pushed, cancellations (and cancel entries that are not: junk fields, raw bytes) and reads
    of drawn counts, fed alike to a worker reading ahead and one reading twice (the oracle): at every read the same
    entries, cancellations and refusals. The oracle reads through redis-py's client, the other on its kept connection
    (schemas/direct.py), so neither shares the other's commands nor its reply parsing."""
    n = next(_examples)
    ahead = RedisTransport(redis_client, f"ra{n}", "c1")
    twice = RedisTransport(redis_client, f"rt{n}", "c1")
    twice.io._direct = None  # the oracle reads through redis-py's client alone
    for t in (ahead, twice):
        t.register([make_key("prefill"), make_key("decode")], {"slots": 64})
        pre, dec = streams_of(t)
        t.read_streams({pre: 1, dec: 1}, block_ms=0, gather_ms=0)
    seq = itertools.count()
    for op in ops:
        if op[0] == "push":
            jobs = [make_job(f"s{next(seq)}", 0 if op[1] == "prefill" else 1, phase=op[1]) for _ in range(op[2])]
            for t in (ahead, twice):
                push(redis_client, streams_of(t)[0 if op[1] == "prefill" else 1], jobs)
        elif op[0] == "cancel":
            fields = {"ok": cancel_to_fields(f"s{op[2]}"), "junk": {"junk": "1"},
                      "bytes": {b"\xff\x00": b"\xfe" * op[2]}}[op[1]]
            for t in (ahead, twice):
                redis_client.xadd(t.keys.cancellations, fields)  # type: ignore[arg-type]
        else:
            (pre, dec), (pre2, dec2) = streams_of(ahead), streams_of(twice)
            got, cancels, refused = ahead.read_ahead({dec: op[1], pre: op[2]})
            got2 = twice.read_streams({dec2: op[1], pre2: op[2]}, block_ms=0, gather_ms=0)
            cancels2, refused2 = twice.cancellations()
            assert [(d.phase, d.fields) for d in got] == [(d.phase, d.fields) for d in got2]
            assert cancels == cancels2
            assert [(r.reason, r.delivery.fields) for r in refused] == [(r.reason, r.delivery.fields) for r in refused2]
