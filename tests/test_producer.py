"""Producer (Tracker side) against fakeredis[lua] and a real redis-server.

The worker side is simulated by `FakeWorker`: a tiny loop over RedisTransport that answers steps
with made-up tokens (a deterministic function of session and position), no scheduler or engine.
"""

from __future__ import annotations

import re
import threading
import time
import zlib
from dataclasses import dataclass, field

import pytest
import redis

from consumer.ops.sessions import session_accounting
from consumer.transport import FusedCallStats, RedisTransport, TransportSettings
from producer import Backpressure, ResultTimeout, SessionFailed, SessionHandle, job_id
from schemas import (
    Accounting,
    Reason,
    SessionSpec,
    Status,
    StepJob,
    StepResult,
    WireError,
    job_from_fields,
    job_to_fields,
)
from schemas.limits import ID_PATTERN
from tests.producer_drivers import MakeProducer, counting_calls, make_producer
from tests.support import session_results
from tests.test_transport import WORKER, hget_all, make_key, make_spec, xrange
from tests.transport_support import Completion, complete_entries

__all__ = ["make_producer"]  # the fixture: every end-to-end body runs against both drivers


def token_at(session_id: str, position: int) -> int:
    """The token the fake worker samples for the step that ends at `position`."""
    return (zlib.crc32(session_id.encode()) + 31 * position) % 1000 + 10


def expected_tokens(session_id: str, prompt_len: int, n: int) -> list[int]:
    return [token_at(session_id, prompt_len + i) for i in range(n)]


@dataclass
class _Session:
    spec: SessionSpec
    next_pos: int = 0
    generated: int = 0


@dataclass
class FakeWorker:
    """Answers step jobs like a worker would, minus the engine. Run `serve()` in a thread or call
    `step()` by hand."""

    client: redis.Redis
    worker_id: str = WORKER
    lose_state_at: set[tuple[str, int]] = field(default_factory=set)  # (session, start_position): once
    # the first token of a session's first replay sampled one off (an engine breaking the batch-invariance
    # promise once per session: the Tracker, sampling the tokens again, must see it differ)
    diverge_replays: bool = False
    diverged: set[str] = field(default_factory=set)
    settings: TransportSettings = field(default_factory=lambda: TransportSettings(block_ms=20, gather_ms=1))
    sessions: dict[str, _Session] = field(default_factory=dict)
    cancelled: set[str] = field(default_factory=set)
    steps_seen: int = 0
    errors: list[BaseException] = field(default_factory=list)
    answered: dict[str, tuple[StepResult, str | None, str | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.t = RedisTransport(self.client, self.worker_id, "c0", self.settings)
        self.pre, self.dec = self.t.register([make_key("prefill"), make_key("decode")], {"slots": 64})
        self.t.heartbeat()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _answer(self, job: StepJob) -> tuple[StepResult, str | None, str | None]:
        """(result, account, close). A job answered before (a Tracker's re-push) gets its answer again,
        as the worker's delivery ledger does; the completion script does not publish it twice."""
        again = self.answered.get(job.job_id)
        if again is not None:
            return again
        out = self._answer_new(job)
        self.answered[job.job_id] = out
        return out

    def _answer_new(self, job: StepJob) -> tuple[StepResult, str | None, str | None]:
        sid = job.session_id

        def res(status: Status, reason: Reason | None = None, token: int | None = None, finished: bool = False,
                prompt: int = 0, generated: int = 0) -> StepResult:
            return StepResult(job_id=job.job_id, session_id=sid, status=status, reason=reason,
                              position=job.end_position, token=token, finished=finished,
                              accounting=Accounting(prompt_tokens=prompt, generated_tokens=generated,
                                                    engine_seconds=0.001), worker_id=self.worker_id)

        if sid in self.cancelled:
            s = self.sessions.pop(sid, None)
            return res(Status.CANCELLED, Reason.CANCELLED, finished=True), (s.spec.account_id if s else None), (
                "cancelled" if s else None)
        if job.session is not None:
            self.sessions[sid] = _Session(job.session)
        s = self.sessions.get(sid)
        if s is None:
            return res(Status.REJECTED, Reason.UNKNOWN_SESSION), None, None
        if (sid, job.start_position) in self.lose_state_at:
            self.lose_state_at.discard((sid, job.start_position))
            del self.sessions[sid]
            return res(Status.STATE_LOST, Reason.ENGINE_ERROR), s.spec.account_id, None
        if job.start_position != s.next_pos:
            reason = Reason.DUPLICATE if job.start_position < s.next_pos else Reason.POSITION_GAP
            return res(Status.REJECTED, reason), s.spec.account_id, None
        s.next_pos = job.end_position
        prompt = len(job.tokens) if job.phase == "prefill" else 0
        if not job.sample:
            return res(Status.OK, prompt=prompt), s.spec.account_id, None
        token = token_at(sid, job.end_position)
        if self.diverge_replays and job.attempt == 1 and sid not in self.diverged:
            self.diverged.add(sid)
            token += 1
        s.generated += 1
        finished = s.generated >= s.spec.max_tokens or token in s.spec.stop_tokens
        if finished:
            del self.sessions[sid]
        return (res(Status.OK, token=token, finished=finished, prompt=prompt, generated=1), s.spec.account_id,
                "finished" if finished else None)

    def step(self, block_ms: int = 0) -> int:
        self.cancelled.update(self.t.cancellations()[0])
        ds = self.t.read_streams({self.pre: 16, self.dec: 64}, block_ms=block_ms)
        if not ds:
            return 0
        comps = []
        for d in ds:
            try:
                job = job_from_fields(d.fields)
            except WireError:  # pragma: no cover - producer only sends valid jobs
                raise
            result, account, close = self._answer(job)
            comps.append(Completion(d, result, account, d.phase, close))  # type: ignore[arg-type]
        complete_entries(self.t, comps, call=FusedCallStats("decode", len(ds), len(ds), 0.001 * len(ds)))
        self.steps_seen += len(ds)
        return len(ds)

    def serve(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.step(block_ms=20):
                    time.sleep(0.001)  # fakeredis does not block
        except BaseException as e:  # pragma: no cover - surfaced by stop()
            self.errors.append(e)

    def __enter__(self) -> FakeWorker:
        self._thread = threading.Thread(target=self.serve, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(5)
        if self.errors:
            raise self.errors[0]


def results_of(client: redis.Redis, worker: str, session_id: str) -> list[StepResult]:
    """The session's answers, on whichever result stream its jobs named (a Tracker's)."""
    return session_results(client, worker, session_id)


# ------------------------------------------------------------------------------------------ unit-ish


def test_job_ids_are_deterministic_and_valid() -> None:
    a = job_id("sess-1", 0, "decode", 17, 0)
    assert a == job_id("sess-1", 0, "decode", 17, 0)
    assert re.match(ID_PATTERN, a) and len(a) <= 64
    variants = {job_id("sess-1", 0, "decode", 17, 1), job_id("sess-1", 1, "decode", 17, 0),
                job_id("sess-1", 0, "prefill", 17, 0), job_id("sess-1", 0, "decode", 18, 0),
                job_id("sess-2", 0, "decode", 17, 0)}
    assert a not in variants and len(variants) == 5


def test_open_pushes_prefill_chunks_in_one_pipeline(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client, prefill_chunk=512)
    prompt = list(range(1, 1301))
    with counting_calls(p) as c:
        h = p.open(make_spec("s1", max_tokens=4), prompt)
    pushes = [x for x in c.calls if "XADD" in x]
    # one pipeline: the chunks, then the session's record (what resume() rebuilds a handle from)
    assert pushes in (["PIPELINE[MULTI,XADD,XADD,XADD,HSET,EXPIRE,EXEC]"], ["PIPELINE[XADD,XADD,XADD,HSET,EXPIRE]"])
    entries = xrange(redis_client, w.pre)
    jobs = [job_from_fields(f) for _id, f in entries]
    assert [j.start_position for j in jobs] == [0, 512, 1024]
    assert [len(j.tokens) for j in jobs] == [512, 512, 276]
    assert [j.session is not None for j in jobs] == [True, False, False]
    assert [j.sample for j in jobs] == [False, False, True]
    assert sum((j.tokens for j in jobs), ()) == tuple(prompt)
    assert all(j.compat == make_key("prefill").digest and j.phase == "prefill" for j in jobs)
    assert [j.job_id for j in jobs] == [job_id("s1", 0, "prefill", s, 0) for s in (0, 512, 1024)]
    assert h.position == 1300 and h.pending_job == jobs[-1].job_id and h.status == "open"


def test_open_validates(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    FakeWorker(redis_client)
    p = make_producer(redis_client)
    with pytest.raises(ValueError, match="empty"):
        p.open(make_spec("s"), [])
    with pytest.raises(ValueError, match="tokens"):
        p.open(make_spec("s"), [1, -2])
    with pytest.raises(ValueError, match="context"):
        p.open(make_spec("s", ctx=64, max_tokens=60), list(range(10)))
    with pytest.raises(ValueError, match="hop"):
        p.open(make_spec("s"), [1], hop=1)
    with pytest.raises(LookupError):
        p.open(make_spec("s", worker="nobody"), [1])
    with pytest.raises(ValueError, match="advertise"):
        p.open(make_spec("s", ctx=2048), [1])  # the worker advertises ctx 4096 only
    assert redis_client.xlen(FakeWorker(redis_client).pre) == 0


def test_discover_and_workers(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    FakeWorker(redis_client)  # heartbeats
    other = RedisTransport(redis_client, "w2")
    other.register([make_key("decode", arch="llama")], {"slots": 2})  # never beats
    p = make_producer(redis_client)
    info = p.discover(WORKER)
    assert info.alive and info.heartbeat_age_s is not None and info.heartbeat_age_s < 5
    assert info.info == {"slots": 64, "wire_version": 2} and {k.phase for k in info.keys} == {"prefill", "decode"}
    ws = p.workers()
    assert [w.worker_id for w in ws] == [WORKER, "w2"]
    assert [w.alive for w in ws] == [True, False] and ws[1].heartbeat_age_s is None
    with pytest.raises(LookupError):
        p.discover("ghost")


# ------------------------------------------------------------------------------------------ end to end


def test_generate_yields_the_sessions_tokens(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    p = make_producer(redis_client, prefill_chunk=4, timeout_s=10)
    with FakeWorker(redis_client):
        tokens = list(p.generate(make_spec("g1", max_tokens=6), list(range(1, 11))))
    assert tokens == expected_tokens("g1", 10, 6)
    rs = results_of(redis_client, WORKER, "g1")
    assert [r.status for r in rs] == [Status.OK] * (3 + 5) and rs[-1].finished
    acct = session_accounting(redis_client, WORKER, "g1")
    assert acct["prompt_tokens"] == "10" and acct["generated_tokens"] == "6" and acct["closed"] == "finished"


def test_generate_stops_on_a_stop_token(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    stop = token_at("g2", 5 + 2)  # the third generated token
    p = make_producer(redis_client, timeout_s=10)
    with FakeWorker(redis_client):
        tokens = list(p.generate(make_spec("g2", max_tokens=50, stop_tokens=(stop,)), [1, 2, 3, 4, 5]))
    assert tokens == expected_tokens("g2", 5, 3) and tokens[-1] == stop


def test_run_many_drives_concurrent_staggered_sessions(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    n = 12
    sessions = [(make_spec(f"m{i}", account=f"acct-{i % 3}", max_tokens=3 + i % 4), list(range(1, 2 + i)))
                for i in range(n)]
    seen: list[tuple[str, int]] = []

    def on_result(h: SessionHandle, r: StepResult) -> None:
        assert r.session_id == h.session_id
        seen.append((h.session_id, r.position))

    p = make_producer(redis_client, prefill_chunk=3, timeout_s=10)
    with FakeWorker(redis_client) as w:
        handles = p.run_many(sessions, on_result=on_result, start_times=[0.005 * i for i in range(n)])
    assert set(handles) == {f"m{i}" for i in range(n)}
    for i, (spec, prompt) in enumerate(sessions):
        h = handles[spec.session_id]
        assert h.finished and h.status == "finished" and h.attempt == 0
        assert h.generated == expected_tokens(spec.session_id, len(prompt), spec.max_tokens), i
        positions = [pos for sid, pos in seen if sid == spec.session_id]
        assert positions == sorted(positions)  # per-session order
    # accounting invariant over what the fake worker charged
    wacct = hget_all(redis_client, w.t.keys.worker_account)
    sessions_acct = [session_accounting(redis_client, WORKER, s.session_id) for s, _ in sessions]
    assert sum(int(a["generated_tokens"]) for a in sessions_acct) == int(wacct["generated_tokens"]) == sum(
        s.max_tokens for s, _ in sessions)
    assert sum(int(a["prompt_tokens"]) for a in sessions_acct) == int(wacct["prompt_tokens"]) == sum(
        len(pr) for _, pr in sessions)
    assert sum(float(a["engine_seconds"]) for a in sessions_acct) == pytest.approx(
        float(wacct["engine_seconds_share"]))


def test_read_results_is_one_xread_for_many_sessions(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client)
    handles = [p.open(make_spec(f"r{i}", max_tokens=2), [1, 2, 3]) for i in range(20)]
    while w.step():
        pass
    with counting_calls(p) as c:
        got = p.read_results(handles, block_ms=100)
    assert c.calls == ["XREAD"]
    assert set(got) == {h.session_id for h in handles}
    for h in handles:
        assert h.generated == [token_at(h.session_id, 3)] and h.pending_job is None
        assert h.last_result_id != "0-0"
    assert p.read_results(handles, block_ms=0) == {}  # nothing new


def test_retried_open_yields_one_result_per_job(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client, prefill_chunk=2)
    spec = make_spec("dup", max_tokens=2)
    h = p.open(spec, [1, 2, 3, 4, 5])
    p.open(spec, [1, 2, 3, 4, 5])  # a retry: same job ids pushed again
    assert redis_client.xlen(w.pre) == 6
    while w.step():
        pass
    rs = results_of(redis_client, WORKER, "dup")
    assert [r.job_id for r in rs] == [job_id("dup", 0, "prefill", s, 0) for s in (0, 2, 4)]
    assert all(r.status == Status.OK for r in rs)  # the duplicates' rejections were never published
    got = p.read_results([h], block_ms=0)
    assert len(got["dup"]) == 3 and h.generated == [token_at("dup", 5)]
    assert session_accounting(redis_client, WORKER, "dup")["steps"] == "3"


def test_replay_after_state_lost(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    prompt = [5, 6, 7, 8]
    lost_at = len(prompt) + 2  # the decode step feeding the third generated token
    p = make_producer(redis_client, prefill_chunk=3, timeout_s=10)
    with FakeWorker(redis_client, lose_state_at={("rp", lost_at), ("rq", 0)}):
        handles = p.run_many([(make_spec("rp", max_tokens=6), prompt), (make_spec("rq", max_tokens=2), prompt)])
    for sid, n in (("rp", 6), ("rq", 2)):
        h = handles[sid]
        assert h.finished and h.status == "finished" and h.attempt == 1
        assert h.generated == expected_tokens(sid, len(prompt), n)  # same tokens as without the fault
    statuses = [r.status for r in results_of(redis_client, WORKER, "rp")]
    assert Status.STATE_LOST in statuses


def test_manual_replay_flow(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    """The documented caller flow: read_results -> status state_lost -> replay() -> continue."""
    w = FakeWorker(redis_client, lose_state_at={("man", 3)})
    p = make_producer(redis_client)
    h = p.open(make_spec("man", max_tokens=3), [1, 2, 3])
    w.step()
    p.read_results([h], block_ms=0)
    assert h.generated == [token_at("man", 3)]
    p.push_decode(h, h.generated[-1])  # position 3: the worker loses the session here
    w.step()
    (r,) = p.read_results([h], block_ms=0)["man"]
    assert r.status == Status.STATE_LOST and h.status == "state_lost" and not h.finished
    p.replay(h)
    assert h.attempt == 1 and h.position == 4 and h.status == "open"
    replayed = [job_from_fields(f) for _id, f in xrange(redis_client, w.pre)][-1]
    assert replayed.tokens == (1, 2, 3, token_at("man", 3)) and replayed.attempt == 1
    assert replayed.session is not None and replayed.session.max_tokens == 2
    while not h.finished:
        w.step()
        p.read_results([h], block_ms=0)
        if not h.finished and h.pending_job is None:
            p.push_decode(h, h.generated[-1])
    assert h.generated == expected_tokens("man", 3, 3) and h.status == "finished"


def test_replay_disabled_or_exhausted(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    p = make_producer(redis_client, timeout_s=10, max_attempts=0)
    with FakeWorker(redis_client, lose_state_at={("x", 0), ("y", 0)}):
        handles = p.run_many([(make_spec("x", max_tokens=2), [1])], replay_state_lost=False)
        assert handles["x"].finished and handles["x"].status == "state_lost"
        with pytest.raises(SessionFailed):
            list(p.generate(make_spec("y", max_tokens=2), [1]))


def test_cancel_reaches_the_worker(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client)
    h = p.open(make_spec("c1", max_tokens=100), [1, 2])
    w.step()
    p.read_results([h], block_ms=0)
    p.push_decode(h, h.generated[-1])
    p.cancel(WORKER, "c1")
    assert w.step() == 1
    (r,) = p.read_results([h], block_ms=0)["c1"]
    assert r.status == Status.CANCELLED and h.finished and h.status == "cancelled"
    assert session_accounting(redis_client, WORKER, "c1")["closed"] == "cancelled"
    assert w.t.cancellations()[0] == []


def test_backpressure_raises_or_waits(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client, max_lag=3)
    for i in range(4):
        p.open(make_spec(f"b{i}"), [1])
    p.core.lag.clear()  # the lag is cached ~100 ms
    with pytest.raises(Backpressure):
        p.open(make_spec("b-over"), [1])
    waiting = make_producer(redis_client, max_lag=3, backpressure="wait", timeout_s=0.2)
    with pytest.raises(Backpressure):
        waiting.open(make_spec("b-wait"), [1])
    w.t.read_streams({w.pre: 4}, block_ms=0)  # the worker catches up: lag 0
    waiting.core.lag.clear()
    waiting.open(make_spec("b-ok"), [1])
    unbounded = make_producer(redis_client, max_lag=None)
    for i in range(5):
        unbounded.open(make_spec(f"u{i}"), [1])


def test_result_timeout(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    FakeWorker(redis_client)  # advertised, but nobody serves
    p = make_producer(redis_client, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout):
        next(iter(p.generate(make_spec("t"), [1])))
    assert time.monotonic() - t0 < 5


def test_old_attempt_results_are_ignored(redis_client: redis.Redis, make_producer: MakeProducer) -> None:
    w = FakeWorker(redis_client)
    p = make_producer(redis_client)
    h = p.open(make_spec("old", max_tokens=4), [1, 2])
    stale = StepJob(job_id=job_id("old", 0, "decode", 99, 0), session_id="old", phase="decode",
                    compat=make_key("decode").digest, start_position=99, tokens=(1,), created_at=time.time())
    redis_client.xadd(w.dec, job_to_fields(stale))  # type: ignore[arg-type]
    w.step()
    got = p.read_results([h], block_ms=0)
    assert [r.job_id for r in got["old"]] == [h.last_result.job_id if h.last_result else ""]
    assert len(results_of(redis_client, WORKER, "old")) == 2  # the stray rejection was published ...
    assert h.status == "open" and h.generated == [token_at("old", 2)]  # ... but not applied
