"""RedisTransport against fakeredis[lua] and a real redis-server (same bodies via `redis_client`).

Blocking/timing behaviour is asserted on `real_redis` only (fakeredis does not block, see
shared/notes/redis-streams.md). The helpers at the top are shared with tests/test_producer.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from consumer.ops.sessions import session_accounting
from consumer.transport import (
    DeadLetter,
    Delivery,
    FusedCallStats,
    RedisTransport,
    TransportSettings,
)
from consumer.transport.connection import Direct
from schemas import (
    GROUP,
    Accounting,
    CompatibilityKey,
    Phase,
    Reason,
    RouteHop,
    SessionSpec,
    Status,
    StepJob,
    StepResult,
    WireError,
    job_from_fields,
    job_to_fields,
    results_from_fields,
)
from schemas.keys import WORKERS_INDEX
from tests.support import compat_key
from tests.transport_support import Completion, complete_entries

WORKER = "w1"


# ------------------------------------------------------------------------------------------ helpers


def make_key(phase: Phase = "decode", ctx: int = 4096, arch: str = "gemma3") -> CompatibilityKey:
    return compat_key(phase, architecture=arch, ctx=ctx)


def make_spec(session_id: str, *, worker: str = WORKER, account: str = "acct-1", max_tokens: int = 8,
              stop_tokens: tuple[int, ...] = (), ctx: int = 4096) -> SessionSpec:
    return SessionSpec(session_id=session_id, account_id=account,
                       route=(RouteHop(worker_id=worker, key=make_key("prefill", ctx)),),
                       max_tokens=max_tokens, stop_tokens=stop_tokens)


def make_job(session_id: str, position: int, *, phase: Phase = "decode", job_id: str | None = None,
             token: int = 1, attempt: int = 0) -> StepJob:
    opening = phase == "prefill" and position == 0
    return StepJob(job_id=job_id or f"{session_id}-{phase[0]}{position}-{attempt}", session_id=session_id,
                   phase=phase, compat=make_key(phase).digest, start_position=position, tokens=(token,),
                   attempt=attempt, created_at=time.time(), session=make_spec(session_id) if opening else None)


def ok_result(job: StepJob, *, token: int = 7, finished: bool = False, prompt: int = 0, generated: int = 1,
              secs: float = 0.001, batch_size: int = 1, worker: str = WORKER) -> StepResult:
    return StepResult(job_id=job.job_id, session_id=job.session_id, status=Status.OK,
                      position=job.end_position, token=token, finished=finished,
                      accounting=Accounting(prompt_tokens=prompt, generated_tokens=generated, engine_seconds=secs),
                      worker_id=worker, batch_size=batch_size)


def push(client: redis.Redis, stream: str, jobs: Sequence[StepJob]) -> list[str]:
    pipe = client.pipeline(transaction=False)
    for j in jobs:
        pipe.xadd(stream, job_to_fields(j))  # type: ignore[arg-type]
    return [x.decode() for x in pipe.execute()]


def completions_for(ds: Sequence[Delivery], *, account: str | None = "acct-1", **kw: Any) -> list[Completion]:
    out = []
    for d in ds:
        job = job_from_fields(d.fields)
        out.append(Completion(d, ok_result(job, **kw), account, d.phase))
    return out


class CommandCounter:
    """Counts client round trips: each execute_command (a script call included) and each pipeline
    execute is one. Names are recorded, pipelines as 'PIPELINE[<commands>]'."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.calls: list[str] = []
        self._orig_exec = client.execute_command
        self._orig_pipe = client.pipeline
        self._orig_direct = Direct.__call__

    def __enter__(self) -> CommandCounter:
        def execute_command(*args: Any, **kw: Any) -> Any:
            self.calls.append(str(args[0]).upper())
            return self._orig_exec(*args, **kw)

        def pipeline(*args: Any, **kw: Any) -> Any:
            pipe = self._orig_pipe(*args, **kw)
            orig_execute = pipe.execute

            def execute(*a: Any, **k: Any) -> Any:
                names = ",".join(str(c[0][0]).upper() for c in pipe.command_stack)
                self.calls.append(f"PIPELINE[{names}]")
                return orig_execute(*a, **k)

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        def direct(d: Direct, *commands: tuple[Any, ...]) -> list[Any]:
            if d.client is self.client:  # the transport's kept connection (consumer/transport/connection.py)
                names = [str(c[0]).upper() for c in commands]
                self.calls.append(names[0] if len(names) == 1 else f"PIPELINE[{','.join(names)}]")
            return self._orig_direct(d, *commands)

        self.client.execute_command = execute_command  # type: ignore[method-assign]
        self.client.pipeline = pipeline  # type: ignore[method-assign]
        Direct.__call__ = direct  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.client.execute_command
        del self.client.pipeline
        Direct.__call__ = self._orig_direct  # type: ignore[method-assign]

    def reset(self) -> None:
        self.calls.clear()


@contextmanager
def counting(client: redis.Redis) -> Iterator[CommandCounter]:
    with CommandCounter(client) as c:
        yield c


def xrange(client: redis.Redis, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    entries: Any = client.xrange(key)
    return list(entries)


def hget_all(client: redis.Redis, key: str) -> dict[str, str]:
    """A hash as text (a tally's binary values as latin-1: compared, never read)."""
    return {k.decode(): v.decode("latin-1") for k, v in client.hgetall(key).items()}  # type: ignore[union-attr]


@pytest.fixture
def transport(redis_client: redis.Redis) -> RedisTransport:
    t = RedisTransport(redis_client, WORKER, "c1")
    t.register([make_key("prefill"), make_key("decode")], {"slots": 64})
    return t


def streams_of(t: RedisTransport) -> tuple[str, str]:
    pre, dec = t.streams
    assert pre.endswith(":prefill") and dec.endswith(":decode")
    return pre, dec


# ------------------------------------------------------------------------------------------ registration


def test_register_is_idempotent_and_advertises(redis_client: redis.Redis) -> None:
    t = RedisTransport(redis_client, WORKER)
    keys = [make_key("prefill"), make_key("decode")]
    streams = t.register(keys, {"slots": 8})
    assert streams == t.register(keys, {"slots": 8})  # BUSYGROUP ignored
    assert streams == [f"dgr:{{{WORKER}}}:in:{k.digest}:{k.phase}" for k in keys]
    for s in streams:
        groups = redis_client.xinfo_groups(s)
        assert [g["name"] for g in groups] == [GROUP.encode()]
    spec = json.loads(redis_client.get(t.keys.spec))  # type: ignore[arg-type]
    assert spec["worker_id"] == WORKER and spec["streams"] == streams
    assert spec["info"] == {"slots": 8, "wire_version": 2}
    assert [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec["keys"]] == keys
    assert redis_client.sismember(WORKERS_INDEX, WORKER)
    t.heartbeat({"free_slots": 3})
    hb = json.loads(redis_client.get(t.keys.heartbeat))  # type: ignore[arg-type]
    assert hb["free_slots"] == 3 and hb["consumer"] == "c0" and abs(hb["ts"] - time.time()) < 5
    assert 0 < redis_client.ttl(t.keys.heartbeat) <= 10


def test_rejects_foreign_streams_and_decoded_clients(redis_client: redis.Redis, transport: RedisTransport) -> None:
    with pytest.raises(ValueError):
        transport.read_streams({"dgr:{other}:in:0123456789abcdef:decode": 1})
    with pytest.raises(ValueError):
        transport.read_streams({"not-a-stream": 1})
    with pytest.raises(ValueError):
        RedisTransport(redis.Redis(decode_responses=True), WORKER)


# ------------------------------------------------------------------------------------------ reading


def test_read_caps_each_stream_at_its_count(redis_client: redis.Redis, transport: RedisTransport) -> None:
    pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 5) for i in range(10)])
    push(redis_client, pre, [make_job(f"p{i}", 0, phase="prefill") for i in range(3)])
    first = transport.read_streams({dec: 4, pre: 0})
    assert [d.stream for d in first] == [dec] * 4
    assert all(isinstance(d.stream, str) and d.phase == "decode" and d.digest == make_key().digest for d in first)
    second = transport.read_streams({dec: 10, pre: 2}, block_ms=0)
    assert sum(d.stream == dec for d in second) == 6 and sum(d.stream == pre for d in second) == 2
    assert [d.stream for d in transport.read_streams({dec: 3, pre: 3}, block_ms=0)] == [pre]  # 1 left
    got = [job_from_fields(d.fields).session_id for d in first + second if d.stream == dec]
    assert got == [f"s{i}" for i in range(10)]  # stream order kept


def test_read_accepts_bytes_stream_names(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job("s", 1)])
    ds = transport.read_streams({dec.encode(): 2}, block_ms=0)  # type: ignore[dict-item]
    assert [d.stream for d in ds] == [dec]


def test_read_gathers_up_to_counts_and_respects_more(redis_client: redis.Redis, transport: RedisTransport) -> None:
    pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 3) for i in range(6)])
    push(redis_client, pre, [make_job(f"p{i}", 0, phase="prefill") for i in range(5)])
    transport.read_streams({dec: 1}, block_ms=0, gather_ms=0)  # drains the (empty) pending lists
    calls: list[int] = []

    def more(ds: list[Delivery]) -> bool:
        calls.append(len(ds))
        return False

    ds = transport.read_streams({dec: 3, pre: 2}, block_ms=0, gather_ms=50, more=more)
    assert sum(d.stream == dec for d in ds) == 3 and sum(d.stream == pre for d in ds) == 2
    assert calls == []  # everything was filled by the first read: no gather
    ds = transport.read_streams({dec: 5, pre: 5}, block_ms=0, gather_ms=50, more=more)
    assert len(ds) == 2 + 3 and calls == [5]  # under its counts, but more() said stop


def test_at_least_once_pending_reread_after_restart(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(5)])
    held = transport.read_streams({dec: 3}, block_ms=0)  # worker "crashes" holding 3
    assert len(held) == 3
    push(redis_client, dec, [make_job("late", 1)])
    again = RedisTransport(redis_client, WORKER, "c1")  # restart, same consumer name
    again.register([make_key("prefill"), make_key("decode")], {})
    first = again.read_streams({dec: 2}, block_ms=0, gather_ms=0)
    assert [d.entry_id for d in first] == [d.entry_id for d in held[:2]]
    assert first[0].fields == held[0].fields
    second = again.read_streams({dec: 2}, block_ms=0, gather_ms=0)
    assert [d.entry_id for d in second][:1] == [held[2].entry_id]
    rest = again.read_streams({dec: 10}, block_ms=0, gather_ms=0)
    names = [job_from_fields(d.fields).session_id for d in second + rest]
    assert names == ["s2", "s3", "s4", "late"]
    # every entry was delivered; after completing them all nothing is pending
    everything = first + second + rest
    assert all(complete_entries(again, completions_for(everything)))
    assert redis_client.xpending(dec, GROUP)["pending"] == 0
    assert again.input_lag()[dec] == {"length": 6, "lag": 0, "pending": 0}


def test_trimmed_pending_entry_returns_with_empty_fields(redis_client: redis.Redis,
                                                         transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job("s", 1)])
    (d,) = transport.read_streams({dec: 1}, block_ms=0)
    redis_client.xtrim(dec, maxlen=0)
    again = RedisTransport(redis_client, WORKER, "c1")
    (d2,) = again.read_streams({dec: 1}, block_ms=0)
    assert d2.entry_id == d.entry_id and d2.fields == {}
    with pytest.raises(WireError) as e:
        job_from_fields(d2.fields)
    complete_entries(again, [], [DeadLetter(d2, e.value.reason, str(e.value))])
    (dl,) = xrange(redis_client, again.keys.dead_letters)
    assert dl[1][b"reason"] == b"malformed" and dl[1][b"entry_id"] == d.entry_id.encode()


def test_read_recreates_a_deleted_group(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    transport.read_streams({dec: 1}, block_ms=0)
    redis_client.flushall()
    assert transport.read_streams({dec: 1}, block_ms=0) == []
    push(redis_client, dec, [make_job("s", 1)])
    assert len(transport.read_streams({dec: 1}, block_ms=0)) == 1


def test_read_blocks_until_an_entry_arrives(real_redis: redis.Redis) -> None:
    t = RedisTransport(real_redis, WORKER)
    _pre, dec = t.register([make_key("prefill"), make_key("decode")], {})
    t.read_streams({dec: 1}, block_ms=0)
    timer = threading.Timer(0.2, lambda: push(real_redis, dec, [make_job("s", 1)]))
    t0 = time.monotonic()
    timer.start()
    ds = t.read_streams({dec: 4}, block_ms=3000, gather_ms=0)
    elapsed = time.monotonic() - t0
    timer.join()
    assert len(ds) == 1 and 0.1 < elapsed < 2.5
    t0 = time.monotonic()
    assert t.read_streams({dec: 4}, block_ms=100, gather_ms=0) == []
    assert 0.05 < time.monotonic() - t0 < 1.0


def test_gather_collects_entries_arriving_after_the_wakeup(real_redis: redis.Redis) -> None:
    t = RedisTransport(real_redis, WORKER)
    _pre, dec = t.register([make_key("prefill"), make_key("decode")], {})
    t.read_streams({dec: 1}, block_ms=0)

    def producer() -> None:
        for i in range(4):
            push(real_redis, dec, [make_job(f"s{i}", 1)])
            time.sleep(0.01)

    th = threading.Thread(target=producer)
    th.start()
    ds = t.read_streams({dec: 4}, block_ms=2000, gather_ms=500)
    th.join()
    assert len(ds) == 4  # a blocked read wakes on the first; the bounded gather takes the rest


# ------------------------------------------------------------------------------------------ completion


def test_complete_publishes_once_and_replay_is_a_noop(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 4) for i in range(3)])
    ds = transport.read_streams({dec: 3}, block_ms=0)
    comps = completions_for(ds, generated=1, secs=0.25)
    call = FusedCallStats("decode", batch_size=3, tokens=3, engine_seconds=0.75)
    assert complete_entries(transport, comps, call=call) == [True, True, True]
    snapshot = {k: hget_all(redis_client, k) for k in (transport.keys.worker_account, transport.keys.tally,
                                                       transport.keys.session_account("s0"),
                                                       transport.keys.billing_account("acct-1"))}
    assert complete_entries(transport, comps, call=call) == [False, False, False]  # replay
    assert {k: hget_all(redis_client, k) for k in snapshot} == snapshot
    for i in range(3):
        entries = xrange(redis_client, transport.keys.results(f"s{i}"))
        assert len(entries) == 1
        (r,) = results_from_fields(entries[0][1])
        want = comps[i].result
        assert (r.job_id, r.session_id, r.status, r.position, r.token, r.worker_id) == (
            want.job_id, want.session_id, want.status, want.position, want.token, want.worker_id)
        assert r.accounting == Accounting(generated_tokens=1, engine_seconds=0.25) and r.batch_size == 3
        assert not redis_client.exists(transport.keys.result_record(r.job_id))  # ok answers: the tally decides
        assert 0 < redis_client.ttl(transport.keys.results(f"s{i}")) <= 86_400
        assert session_accounting(redis_client, WORKER, f"s{i}")["generated_tokens"] == "1"
    w = snapshot[transport.keys.worker_account]
    assert w["fused_calls"] == "1" and w["batch_size:3"] == "1" and w["tokens:decode"] == "3"
    assert w["results:ok"] == "3" and w["generated_tokens"] == "3" and float(w["engine_seconds"]) == 0.75
    assert float(w["engine_seconds_share"]) == pytest.approx(0.75)
    assert redis_client.xpending(dec, GROUP)["pending"] == 0
    assert complete_entries(transport, []) == []


def test_same_job_id_pushed_twice_yields_one_result(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    job = make_job("s", 4, job_id="retried-job")
    push(redis_client, dec, [job, job])  # a producer retry
    a, b = transport.read_streams({dec: 2}, block_ms=0)
    assert complete_entries(transport, completions_for([a, b])) == [True, False]  # same batch
    push(redis_client, dec, [job])  # and once more, completed in a later batch
    (c,) = transport.read_streams({dec: 2}, block_ms=0)
    assert complete_entries(transport, completions_for([c])) == [False]
    assert [r.job_id for _, f in xrange(redis_client, transport.keys.results("s")) for r in results_from_fields(f)] \
        == ["retried-job"]
    assert session_accounting(redis_client, WORKER, "s")["steps"] == "1"
    assert redis_client.xpending(dec, GROUP)["pending"] == 0


def test_per_session_result_order(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    for pos in range(10):
        push(redis_client, dec, [make_job("a", pos), make_job("b", 100 + pos)])
        ds = transport.read_streams({dec: 8}, block_ms=0)
        complete_entries(transport, completions_for(ds, token=pos))
    for sid, base in (("a", 0), ("b", 100)):
        rs = [r for _id, f in xrange(redis_client, transport.keys.results(sid)) for r in results_from_fields(f)]
        assert [r.position for r in rs] == [base + p + 1 for p in range(10)]
        assert [r.token for r in rs] == list(range(10))


def test_accounting_invariant(redis_client: redis.Redis, transport: RedisTransport) -> None:
    pre, dec = streams_of(transport)
    sessions = [f"s{i}" for i in range(6)]
    accounts = {s: f"acct-{i % 2}" for i, s in enumerate(sessions)}
    total_call_seconds = 0.0
    for step in range(5):
        phase: Phase = "prefill" if step == 0 else "decode"
        stream = pre if step == 0 else dec
        jobs = [make_job(s, step, phase=phase) for s in sessions[: 6 - step]]
        push(redis_client, stream, jobs)
        ds = transport.read_streams({stream: 16}, block_ms=0)
        call_seconds = 0.01 * (step + 1)
        share = call_seconds / len(ds)
        comps = []
        for d in ds:
            job = job_from_fields(d.fields)
            last = job.session_id == sessions[5 - step] and step > 0
            r = ok_result(job, prompt=1 if phase == "prefill" else 0, generated=1, secs=share, finished=last)
            comps.append(Completion(d, r, accounts[job.session_id], phase, "finished" if last else None))
        call = FusedCallStats(phase, len(ds), len(ds), call_seconds)
        assert all(complete_entries(transport, comps, call=call))
        complete_entries(transport, comps, call=call)  # replays change nothing
        total_call_seconds += call_seconds
    w = hget_all(redis_client, transport.keys.worker_account)
    per_session = [session_accounting(redis_client, WORKER, s) for s in sessions]
    for field in ("prompt_tokens", "generated_tokens", "steps"):
        assert sum(int(s[field]) for s in per_session) == int(w[field])
        by_acct = [hget_all(redis_client, transport.keys.billing_account(a)) for a in ("acct-0", "acct-1")]
        assert sum(int(a[field]) for a in by_acct) == int(w[field])
    assert sum(float(s["engine_seconds"]) for s in per_session) == pytest.approx(float(w["engine_seconds_share"]))
    assert float(w["engine_seconds_share"]) == pytest.approx(total_call_seconds)
    assert float(w["engine_seconds"]) == pytest.approx(total_call_seconds)
    assert int(w["fused_calls"]) == 5 and int(w["calls:decode"]) == 4 and int(w["calls:prefill"]) == 1
    assert int(w["prompt_tokens"]) == 6
    assert {k: v for k, v in w.items() if k.startswith("batch_size:")} == {f"batch_size:{n}": "1" for n in
                                                                          (6, 5, 4, 3, 2)}
    assert redis_client.smembers(transport.keys.accounts_index) == {b"acct-0", b"acct-1"}
    assert per_session[0]["account"] == "acct-0" and per_session[4]["closed"] == "finished"
    assert "closed" not in per_session[0]


def test_unknown_session_is_not_charged_to_an_account(redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job("ghost", 3)])
    (d,) = transport.read_streams({dec: 1}, block_ms=0)
    job = job_from_fields(d.fields)
    r = StepResult(job_id=job.job_id, session_id=job.session_id, status=Status.REJECTED,
                   reason=Reason.UNKNOWN_SESSION, position=3, worker_id=WORKER)
    assert complete_entries(transport, [Completion(d, r, None, "decode", "cancelled")]) == [True]
    assert redis_client.scard(transport.keys.accounts_index) == 0
    # no per-session key outlives the reject ttl: no session hash at all, the answer expires soon
    assert not redis_client.exists(transport.keys.session_account("ghost"))
    reject_ttl = transport.settings.reject_ttl_s
    assert 0 < redis_client.ttl(transport.keys.result_record(job.job_id)) <= reject_ttl
    assert 0 < redis_client.ttl(transport.keys.results("ghost")) <= reject_ttl
    assert hget_all(redis_client, transport.keys.worker_account)["results:rejected"] == "1"


def test_malformed_entries_dead_lettered_alongside_completions(redis_client: redis.Redis,
                                                              transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    good = make_job("good", 2)
    bad_v = job_to_fields(make_job("v3", 2)) | {"v": "3"}
    redis_client.xadd(dec, job_to_fields(good))  # type: ignore[arg-type]
    redis_client.xadd(dec, {b"j": b"\xff\xfe", b"v": b"2"})  # not UTF-8
    redis_client.xadd(dec, {"hello": "world"})  # wrong fields
    redis_client.xadd(dec, bad_v)  # type: ignore[arg-type]
    ds = transport.read_streams({dec: 8}, block_ms=0)
    comps, dead = [], []
    for d in ds:
        try:
            job = job_from_fields(d.fields)
        except WireError as e:
            dead.append(DeadLetter(d, e.reason, str(e)))
        else:
            comps.append(Completion(d, ok_result(job), "acct", "decode"))
    assert [dl.reason for dl in dead] == [Reason.MALFORMED, Reason.MALFORMED, Reason.SCHEMA_VERSION]
    assert complete_entries(transport, comps, dead) == [True]
    assert complete_entries(transport, comps, dead) == [False]  # replay: no second dead letter either
    dlq = xrange(redis_client, transport.keys.dead_letters)
    assert len(dlq) == 3
    for (_id, f), dl in zip(dlq, dead, strict=True):
        assert f[b"reason"] == dl.reason.value.encode() and f[b"stream"] == dec.encode()
        assert f[b"entry_id"] == dl.delivery.entry_id.encode() and f[b"detail"] == dl.detail.encode()
        assert {k[2:]: v for k, v in f.items() if k.startswith(b"f:")} == dl.delivery.fields
    assert redis_client.xlen(transport.keys.results("good")) == 1
    assert redis_client.xpending(dec, GROUP)["pending"] == 0
    assert hget_all(redis_client, transport.keys.worker_account)["dead_letters"] == "3"


def test_one_delivery_rejected_and_dead_lettered_in_one_call(redis_client: redis.Redis,
                                                           transport: RedisTransport) -> None:
    """The worker tells the session (a rejection) and keeps the entry (a dead letter) at once."""
    _pre, dec = streams_of(transport)
    redis_client.xadd(dec, job_to_fields(make_job("v9", 2)) | {"v": "9"})  # type: ignore[arg-type]
    (d,) = transport.read_streams({dec: 1}, block_ms=0)
    with pytest.raises(WireError) as e:
        job_from_fields(d.fields)
    assert e.value.session_id == "v9" and e.value.job_id is not None
    r = StepResult(job_id=e.value.job_id, session_id="v9", status=Status.REJECTED, reason=e.value.reason,
                   detail=str(e.value)[:256], position=0, worker_id=WORKER)
    comp, dead = Completion(d, r, None, "decode"), DeadLetter(d, e.value.reason, str(e.value))
    assert complete_entries(transport, [comp], [dead]) == [True]
    assert complete_entries(transport, [comp], [dead]) == [False]
    assert redis_client.xlen(transport.keys.results("v9")) == 1
    ((_id, f),) = xrange(redis_client, transport.keys.dead_letters)
    assert f[b"reason"] == b"schema_version" and f[b"f:v"] == b"9"
    assert redis_client.xpending(dec, GROUP)["pending"] == 0


# ------------------------------------------------------------------------------------------ recovery


def test_takeover_claims_a_dead_consumers_entries_at_once(redis_client: redis.Redis,
                                                          transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(3)])
    held = transport.read_streams({dec: 3}, block_ms=0)  # c1 dies holding them
    fresh = RedisTransport(redis_client, WORKER, "c2")
    fresh.register([make_key("prefill"), make_key("decode")], {})
    taken, dead = fresh.recover_streams()  # by ownership: no idle time to wait for
    assert dead == [] and [d.entry_id for d in taken] == [d.entry_id for d in held]
    assert [d.fields for d in taken] == [d.fields for d in held]
    owners = {p["consumer"] for p in redis_client.xpending_range(dec, GROUP, "-", "+", 10)}
    assert owners == {b"c2"}
    assert {c["name"] for c in redis_client.xinfo_consumers(dec, GROUP)} == {b"c2"}  # the dead name is gone
    assert complete_entries(fresh, completions_for(taken)) == [True] * 3
    assert complete_entries(transport, completions_for(held)) == [False] * 3  # the zombie's late answer
    assert all(redis_client.xlen(fresh.keys.results(f"s{i}")) == 1 for i in range(3))
    assert fresh.recover_streams() == ([], [])


def test_own_entries_are_never_claimed_however_long_they_wait(real_redis: redis.Redis) -> None:
    t = RedisTransport(real_redis, WORKER, "c1")
    _pre, dec = t.register([make_key("prefill"), make_key("decode")], {})
    push(real_redis, dec, [make_job(f"s{i}", 1) for i in range(3)])
    held = t.read_streams({dec: 3}, block_ms=0)
    time.sleep(0.05)  # idle far longer than the old 1 ms claim setting: idle time decides nothing now
    assert t.recover_streams() == ([], [])
    deliveries = [p["times_delivered"] for p in real_redis.xpending_range(dec, GROUP, "-", "+", 10)]
    assert deliveries == [1, 1, 1]
    assert complete_entries(t, completions_for(held)) == [True] * 3


def test_own_entries_the_worker_does_not_hold_are_handed_out_again(redis_client: redis.Redis,
                                                                    transport: RedisTransport) -> None:
    """A read whose reply was lost in a reconnect: the entries sit in our pending list, unheld."""
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(3)])
    held = transport.read_streams({dec: 1}, block_ms=0)
    assert transport.read_streams({dec: 1}, block_ms=0) != []  # drains the pending re-read, reads s1
    lost = redis_client.xreadgroup(GROUP, "c1", {dec: ">"}, count=1)  # s2: read, reply "lost"
    assert lost
    taken, dead = transport.recover_streams()
    assert dead == [] and [job_from_fields(d.fields).session_id for d in taken] == ["s2"]
    assert transport.recover_streams() == ([], [])  # now held: not handed out twice
    assert transport.outstanding == 3
    complete_entries(transport, completions_for(held))
    assert transport.outstanding == 2


class _LostOnce:
    """The client, but its next XREADGROUP runs and its reply is lost (a reset before it was read)."""

    def __init__(self, inner: redis.Redis) -> None:
        self.inner, self.armed = inner, True

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != "xreadgroup":
            return value

        def call(*a: Any, **k: Any) -> Any:
            out = value(*a, **k)
            if self.armed:
                self.armed = False
                raise redis.ConnectionError("injected: the reply was lost")
            return out

        return call


def test_a_read_that_lost_its_reply_hands_its_entries_out_first(redis_client: redis.Redis) -> None:
    """The read is tried again and gets the entries after the lost ones: the lost ones come first, in order, so a
    session's later step never comes before its earlier one (tests/test_lost_replies.py). Found past the entries
    the worker holds, however many (here more than a sweep's claim_count)."""
    transport = RedisTransport(redis_client, WORKER, "c1", TransportSettings(claim_count=2))
    transport.register([make_key("prefill"), make_key("decode")], {})
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(5)])
    held = transport.read_streams({dec: 1}, block_ms=0)
    held += transport.read_streams({dec: 1}, block_ms=0)  # the pending re-read drained: s1 read with '>'
    honest = transport.client
    transport.client = _LostOnce(honest)  # type: ignore[assignment]
    got = transport.read_streams({dec: 2}, block_ms=0)  # s2, s3 lost; the retry reads s4
    transport.client = honest
    assert [job_from_fields(d.fields).session_id for d in got] == ["s2", "s3", "s4"]
    assert transport.recover_streams() == ([], [])  # held now: not handed out twice
    assert transport.outstanding == 5
    complete_entries(transport, completions_for(held + got))
    assert transport.outstanding == 0

def test_recover_leaves_own_entries_to_the_pending_reread_after_a_restart(
        redis_client: redis.Redis, transport: RedisTransport) -> None:
    _pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(3)])
    transport.read_streams({dec: 2}, block_ms=0)
    again = RedisTransport(redis_client, WORKER, "c1")  # a restart under the same consumer name
    again.register([make_key("prefill"), make_key("decode")], {})
    assert again.recover_streams() == ([], [])  # the worker's start(): nothing of its own is claimed
    rest = again.read_streams({dec: 8}, block_ms=0)
    assert [job_from_fields(d.fields).session_id for d in rest] == ["s0", "s1", "s2"]  # each once


def test_dead_letter_after_too_many_deliveries(redis_client: redis.Redis) -> None:
    settings = TransportSettings(max_deliveries=2)
    a = RedisTransport(redis_client, WORKER, "a", settings)
    _pre, dec = a.register([make_key("prefill"), make_key("decode")], {})
    b = RedisTransport(redis_client, WORKER, "b", settings)
    b.register([make_key("prefill"), make_key("decode")], {})
    job = make_job("poison", 9)
    (entry_id,) = push(redis_client, dec, [job])
    assert len(a.read_streams({dec: 1}, block_ms=0)) == 1  # delivery 1
    taken, dead = b.recover_streams()  # delivery 2 (a is gone, b holds the lease): still handed out
    assert [d.entry_id for d in taken] == [entry_id] and dead == []
    taken, dead = a.recover_streams()  # delivery 3 > 2 (a is back, b is gone): dead-lettered
    assert taken == [] and len(dead) == 1
    assert dead[0].reason == Reason.TOO_MANY_DELIVERIES and dead[0].delivery.entry_id == entry_id
    assert dead[0].delivery.given_up == "delivered 3 times (max 2)"
    ((_id, f),) = xrange(redis_client, a.keys.dead_letters)
    assert f[b"reason"] == b"too_many_deliveries" and f[b"deliveries"] == b"3"
    assert f[b"stream"] == dec.encode() and f[b"entry_id"] == entry_id.encode()
    assert job_from_fields({k[2:]: v for k, v in f.items() if k.startswith(b"f:")}) == job
    assert redis_client.xpending(dec, GROUP)["pending"] == 0


def test_pending_reread_dead_letters_a_poison_entry(redis_client: redis.Redis) -> None:
    settings = TransportSettings(max_deliveries=2)
    keys = [make_key("prefill"), make_key("decode")]
    t = RedisTransport(redis_client, WORKER, "c1", settings)
    _pre, dec = t.register(keys, {})
    job = make_job("poison", 9)
    (entry_id,) = push(redis_client, dec, [job])
    assert len(t.read_streams({dec: 1}, block_ms=0)) == 1  # delivery 1, then the worker crashes
    t = RedisTransport(redis_client, WORKER, "c1", settings)
    assert [d.entry_id for d in t.read_streams({dec: 1}, block_ms=0)] == [entry_id]  # delivery 2, crash again
    t = RedisTransport(redis_client, WORKER, "c1", settings)
    (given_up,) = t.read_streams({dec: 1}, block_ms=0)  # delivery 3 > 2: dead-lettered, returned once as such
    assert given_up.entry_id == entry_id and given_up.given_up == "delivered 3 times (max 2)"
    assert t.inbound(given_up).job == job  # decodable: the worker answers its session
    assert [dl.delivery.entry_id for dl in t.dead_lettered] == [entry_id]
    assert redis_client.xlen(t.keys.dead_letters) == 1
    assert redis_client.xpending(dec, GROUP)["pending"] == 0
    assert t.read_streams({dec: 1}, block_ms=0) == []  # never again
    assert RedisTransport(redis_client, WORKER, "c1", settings).read_streams({dec: 1}, block_ms=0) == []


# ------------------------------------------------------------------------------------------ cancellations, lag


def test_cancellations_are_seen_once(redis_client: redis.Redis, transport: RedisTransport) -> None:
    assert transport.cancellations()[0] == []
    for sid in ("a", "b", "c"):
        redis_client.xadd(transport.keys.cancellations, {"session_id": sid})
    assert transport.cancellations()[0] == ["a", "b", "c"]
    assert transport.cancellations()[0] == []
    redis_client.xadd(transport.keys.cancellations, {"session_id": "d"})
    assert transport.cancellations()[0] == ["d"]
    other = RedisTransport(redis_client, WORKER, "c9")  # a restart reads from the beginning
    assert other.cancellations()[0] == ["a", "b", "c", "d"]


def test_input_lag(redis_client: redis.Redis, transport: RedisTransport) -> None:
    pre, dec = streams_of(transport)
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(5)])
    transport.read_streams({dec: 2}, block_ms=0)
    lag = transport.input_lag()
    assert lag[dec] == {"length": 5, "lag": 3, "pending": 2}
    assert lag[pre] == {"length": 0, "lag": 0, "pending": 0}


# ------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_round_trips_per_batch_are_constant(redis_client: redis.Redis, transport: RedisTransport,
                                            batch: int) -> None:
    pre, dec = streams_of(transport)
    transport.read_streams({dec: 1, pre: 1}, block_ms=0)  # the pending re-read of a fresh consumer, once
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(batch)])
    with counting(redis_client) as c:
        ds = transport.read_streams({dec: batch}, block_ms=10, gather_ms=0)
        assert len(ds) == batch and c.calls == ["XREADGROUP"]
        c.reset()
        transport.cancellations()[0]
        assert c.calls == ["XREAD"]
        c.reset()
        comps = completions_for(ds)
        dead = [DeadLetter(ds[0], Reason.MALFORMED, "x")] if batch > 1 else []
        first = complete_entries(transport, comps[1:] if dead else comps, dead,
                                   FusedCallStats("decode", batch, batch, 0.01))
        assert c.calls == ["EVALSHA"]
        assert all(first)
    assert redis_client.xpending(dec, GROUP)["pending"] == 0


def test_round_trips_two_streams_and_first_call_fallback(redis_client: redis.Redis) -> None:
    t = RedisTransport(redis_client, WORKER, "c1")
    pre, dec = t.register([make_key("prefill"), make_key("decode")], {})
    push(redis_client, dec, [make_job(f"s{i}", 1) for i in range(8)])
    push(redis_client, pre, [make_job(f"p{i}", 0, phase="prefill") for i in range(8)])
    with counting(redis_client) as c:
        ds = t.read_streams({dec: 8, pre: 2}, block_ms=10, gather_ms=0)
        # the first read of a consumer re-reads its own pending list (one script call)
        assert c.calls == ["EVALSHA", "PIPELINE[XREADGROUP,XREADGROUP]"] and len(ds) == 10
        c.reset()
        ds += t.read_streams({dec: 8, pre: 2}, block_ms=10, gather_ms=0)
        assert c.calls == ["PIPELINE[XREADGROUP,XREADGROUP]"] and len(ds) == 12
        c.reset()
        redis_client.script_flush()
        c.reset()
        assert all(complete_entries(t, completions_for(ds[:4])))  # NOSCRIPT: EVALSHA, SCRIPT LOAD, EVALSHA
        assert c.calls[0] == "EVALSHA" and len(c.calls) <= 3
        c.reset()
        assert all(complete_entries(t, completions_for(ds[4:])))
        assert c.calls == ["EVALSHA"]
        c.reset()
        assert complete_entries(t, []) == [] and c.calls == []


def time_complete(client: redis.Redis, n: int, rounds: int = 30) -> tuple[float, float]:
    """(median, best) seconds of one complete() of n sessions, on whatever `client` is."""
    t = RedisTransport(client, "bench")
    _pre, dec = t.register([make_key("prefill"), make_key("decode")], {})
    samples = []
    for r in range(rounds):
        push(client, dec, [make_job(f"b{r}-{i}", 1) for i in range(n)])
        ds = t.read_streams({dec: n}, block_ms=0, gather_ms=0)
        comps = completions_for(ds)
        call = FusedCallStats("decode", n, n, 0.01)
        t0 = time.perf_counter()
        complete_entries(t, comps, call=call)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2], samples[0]


def test_measure_complete_wall_time(real_redis: redis.Redis, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a timing assertion: prints the wall time of one complete() (see `pytest -s`)."""
    lines = []
    for n in (1, 8, 64):
        med, best = time_complete(real_redis, n)
        lines.append(f"complete() of {n:3d} sessions: median {med * 1e3:.3f} ms, best {best * 1e3:.3f} ms")
        assert med < 1.0
    with capsys.disabled():
        print("\n" + "\n".join(lines))
