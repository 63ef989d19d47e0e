"""Overlap (issue 15): publishing fused call k's results on the helper thread while the loop runs call
k+1 must change nothing a session or an account can see.

Differential: the same random workload (sessions opened at random iterations, greedy or seeded sampled,
cancelled at a random token, with or without a step in the same read) is driven through a worker with
overlap off (the oracle) and on, on the real redis-server; every session's results (status, position,
token, finished, accounting) and every accounting hash must be identical. The overlap changes which
sessions share a fused call, so the engine is batch-invariant (the sleep engine at 0 s: no arithmetic).
Then the edges: a stop in the middle publishes everything computed, a lease lost in the middle writes
nothing after the takeover.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.batch import EngineOutput, FusedBatch
from consumer.engines.sleep import SleepEngine
from consumer.transport import LeaseLost, RedisTransport
from consumer.worker import Worker, WorkerSettings
from producer import Producer, job_id
from schemas import (
    RouteHop,
    Sampling,
    SessionSpec,
    StepJob,
    StepResult,
    WorkerKeys,
    cancel_to_fields,
    job_to_fields,
    results_from_fields,
)
from tests.support import entry_results

SOAK = os.environ.get("DGR_SOAK") == "1"  # DGR_SOAK=1: the long searches

_runs = itertools.count()
_PER_CALL = (b"fused_calls", b"calls:", b"sessions:", b"tokens:", b"batch_size", b"engine_seconds")


@dataclass(frozen=True)
class Plan:
    opens_at: int  # driver iteration the session opens at
    prompt: tuple[int, ...]
    max_tokens: int
    sampled: bool  # typical sampling (t0.8/k40/p0.95), seeded; else greedy
    cancel_after: int | None  # cancel once this many tokens were seen
    cancel_with_step: bool  # ... pushing its next step too (cancelled while queued), or instead


plans = st.lists(st.builds(
    Plan, opens_at=st.integers(0, 6), prompt=st.lists(st.integers(3, 255), min_size=1, max_size=12).map(tuple),
    max_tokens=st.integers(1, 9), sampled=st.booleans(), cancel_after=st.none() | st.integers(0, 9),
    cancel_with_step=st.booleans()), min_size=1, max_size=6)


class Driver:
    """The Tracker's part by hand: push steps, read results, push the next step or a cancellation."""

    def __init__(self, client: redis.Redis, worker: Worker, wid: str, plans: list[Plan]) -> None:
        self.client, self.worker, self.wid, self.plans = client, worker, wid, plans
        self.key = worker.keys["prefill"]
        self.keys = WorkerKeys(wid)
        self.last = {i: b"0-0" for i in range(len(plans))}
        self.pos: dict[int, int] = {}
        self.seen: dict[int, list[StepResult]] = {i: [] for i in range(len(plans))}
        self.over: set[int] = set()

    def sid(self, i: int) -> str:
        return f"s{i}"

    def push(self, job: StepJob) -> None:
        key = self.key.for_phase(job.phase)
        self.client.xadd(self.keys.input_stream(key.digest, job.phase), job_to_fields(job))  # type: ignore[arg-type]

    def cancel(self, i: int) -> None:
        self.client.set(self.keys.cancel_marker(self.sid(i)), "1", ex=300)
        self.client.xadd(self.keys.cancellations, cancel_to_fields(self.sid(i)))  # type: ignore[arg-type]
        self.over.add(i)

    def step(self, i: int, token: int) -> None:
        p = self.pos[i]
        self.push(StepJob(job_id=f"{self.sid(i)}-{p}", session_id=self.sid(i), phase="decode",
                          compat=self.key.for_phase("decode").digest, start_position=p, tokens=(token,),
                          created_at=time.time()))
        self.pos[i] = p + 1

    def tick(self, it: int) -> None:
        for i, plan in enumerate(self.plans):
            if plan.opens_at == it:
                sampling = (Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=i) if plan.sampled else Sampling())
                spec = SessionSpec(session_id=self.sid(i), account_id=f"acct{i % 2}",
                                   route=(RouteHop(worker_id=self.wid, key=self.key),), sampling=sampling,
                                   max_tokens=plan.max_tokens)
                self.push(StepJob(job_id=f"{self.sid(i)}-0", session_id=self.sid(i), phase="prefill",
                                  compat=self.key.digest, start_position=0, tokens=plan.prompt,
                                  created_at=time.time(), session=spec))
                self.pos[i] = len(plan.prompt)
                if plan.cancel_after == 0:
                    self.cancel(i)
        for i in list(self.pos):
            for entry_id, fields in self.client.xrange(self.keys.results(self.sid(i)), min=b"(" + self.last[i]):
                self.last[i] = entry_id
                for r in results_from_fields(fields):
                    self.seen[i].append(r)
                    if r.token is None or r.finished or i in self.over:
                        continue
                    n = sum(1 for x in self.seen[i] if x.token is not None)
                    if self.plans[i].cancel_after == n:
                        if self.plans[i].cancel_with_step:
                            self.step(i, r.token)
                        self.cancel(i)
                    else:
                        self.step(i, r.token)

    def settled(self) -> bool:
        """Every session finished, answered cancelled, or (cancelled with nothing queued: no answer) closed."""
        def done(i: int) -> bool:
            if i not in self.pos:
                return False
            last = self.seen[i][-1] if self.seen[i] else None
            if last is not None and (last.finished or last.token is None):
                return True
            return i in self.over and self.client.hget(self.keys.session_account(self.sid(i)), "closed") is not None
        return all(done(i) for i in range(len(self.plans)))


def _worker(client: redis.Redis, wid: str, overlap: bool, step_s: float = 0.0, **kw: object) -> Worker:
    engine = SleepEngine(step_s, n_slots=8, ctx_per_session=256)
    settings_ = WorkerSettings(worker_id=wid, block_ms=1, gather_ms=0.0, await_ms=0, max_batch=8,
                               overlap=overlap, **kw)  # type: ignore[arg-type]
    w = Worker(engine, RedisTransport(client, wid, consumer_name=wid), settings_)
    w.start()
    return w


def _accounts(client: redis.Redis, wid: str) -> dict[str, dict[bytes, bytes]]:
    keys = WorkerKeys(wid)
    out = {}
    for k in client.scan_iter(match=f"{keys.base}:acct:*"):
        name = k.decode()[len(keys.base):]
        if client.type(k) == b"hash":
            # what depends on how sessions were batched (calls, rows per call, seconds) is left out
            out[name] = {f: v for f, v in client.hgetall(k).items() if not f.startswith(_PER_CALL)}
    return out


def _run_until_settled(d: Driver, w: Worker, iterations: int = 400, **mode: bool) -> None:
    """The Tracker's ticks and the worker's iterations (run_once(**mode)) until every session ended, then a flush."""
    for it in range(iterations):
        d.tick(it)
        w.run_once(**mode)
        if it > 6 and d.settled():
            break
    w.flush()


def _drive(client: redis.Redis, plans: list[Plan], overlap: bool, here: bool = False
           ) -> tuple[dict[int, list[tuple[object, ...]]], dict[str, dict[bytes, bytes]]]:
    """`here`: with overlap, each call in the loop's thread, its reads and filing on the I/O thread (a long
    call's iteration, Worker._mode)."""
    wid = f"ov{next(_runs)}"
    w = _worker(client, wid, overlap)
    d = Driver(client, w, wid, plans)
    _run_until_settled(d, w, flush=not overlap, here=here)
    d.tick(10_000)
    assert d.settled(), "the workload did not finish"
    seen = {i: [(r.status, r.reason, r.position, r.token, r.finished, r.accounting.prompt_tokens,
                 r.accounting.generated_tokens) for r in rs] for i, rs in d.seen.items()}
    return seen, _accounts(client, wid)


@settings(max_examples=60 if SOAK else 6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=plans)
def test_overlap_changes_no_result_and_no_account(real_redis: redis.Redis, plans: list[Plan]) -> None:
    off = _drive(real_redis, plans, overlap=False)
    on = _drive(real_redis, plans, overlap=True)
    assert on[0] == off[0]
    assert on[1] == off[1]
    here = _drive(real_redis, plans, overlap=True, here=True)
    assert here == off


@pytest.mark.parametrize("step_s", [0.0, 0.025])
def test_a_stop_in_the_middle_publishes_every_call_made(real_redis: redis.Redis, step_s: float) -> None:
    """run() with overlap on, stopped while sessions decode: every token the engine produced is published
    before run() returns (no result left in flight), and the last heartbeat says stopped. Calls of 25 ms (longer
    than overlap_max_call_ms) run in the loop's thread, their reads and filings on the I/O thread."""
    wid = f"ov{next(_runs)}"
    w = _worker(real_redis, wid, overlap=True, step_s=step_s)
    modes: list[dict[str, bool]] = []
    mode = w._mode
    w._mode = lambda: modes.append(mode()) or modes[-1]  # type: ignore[method-assign]
    plans = [Plan(0, (5, 6, 7), 10_000 // 100, False, None, False) for _ in range(6)]
    d = Driver(real_redis, w, wid, plans)
    stop_at = threading.Event()

    def drive() -> None:
        for it in range(10_000):
            if stop_at.is_set():
                return
            d.tick(it)
            if sum(len(v) for v in d.seen.values()) >= 30:
                w.request_stop()
                return
            time.sleep(0.001)

    t = threading.Thread(target=drive)
    t.start()
    w.run(max_idle_s=20)
    stop_at.set()
    t.join()
    assert not w.io.busy
    published = sum(len(entry_results(real_redis.xrange(WorkerKeys(wid).results(d.sid(i))))) for i in range(len(plans)))
    assert published == w.stats.sessions_in_calls  # one result per session per fused call, all out
    assert b'"stopped":true' in (real_redis.get(WorkerKeys(wid).heartbeat) or b"")
    assert ({"flush": False, "here": True} in modes) is (step_s > 0)


@pytest.mark.parametrize("flush", [True, False])
def test_the_heartbeat_is_the_io_threads_when_the_loop_hands_it_redis(real_redis: redis.Redis, flush: bool) -> None:
    """A beat (lease, heartbeat, lag, trim: five round trips, worker/beat.py) goes to the I/O thread with the
    filings when the loop overlaps (the engine does not wait for it), and runs in the loop's thread in line; the
    heartbeat it writes is the loop's state when it was due."""
    wid = f"ov{next(_runs)}"
    w = _worker(real_redis, wid, overlap=not flush, heartbeat_s=0.0)
    threads: list[str] = []
    renew = w.transport.renew_lease

    def renew_lease() -> None:
        threads.append(threading.current_thread().name)
        renew()

    w.transport.renew_lease = renew_lease  # type: ignore[method-assign]
    d = Driver(real_redis, w, wid, [Plan(0, (5, 6, 7), 4, False, None, False)])
    _run_until_settled(d, w, 40, flush=flush)
    assert d.settled() and threads
    assert {t.startswith(f"dgr-io-{wid}") for t in threads} == {not flush}
    hb = json.loads(real_redis.get(WorkerKeys(wid).heartbeat) or b"{}")
    assert hb["worker_id"] == wid and hb["slots"] == 8


@pytest.mark.parametrize("here", [False, True])
def test_a_lease_lost_in_the_middle_writes_nothing_after_the_takeover(real_redis: redis.Redis, here: bool) -> None:
    """The lease is taken over while results are in flight: LeaseLost stops the loop; nothing (result,
    accounting, heartbeat) is written after the takeover, whichever publish was in flight. Beats every 50 ms, on
    the I/O thread behind the filings (worker/beat.py); `here`: each call in the loop's thread (a long call's
    iteration)."""
    wid = f"ov{next(_runs)}"
    w = _worker(real_redis, wid, overlap=True, heartbeat_s=0.05)
    plans = [Plan(0, (5, 6, 7), 100, False, None, False) for _ in range(6)]
    d = Driver(real_redis, w, wid, plans)
    keys = WorkerKeys(wid)
    taken: list[int] = []
    for it in range(2_000):
        d.tick(it)
        if not taken and sum(len(v) for v in d.seen.values()) >= 20:
            pipe = real_redis.pipeline(transaction=True)  # take over and count, atomically
            pipe.set(keys.lease, "99:elsewhere:1:z", px=60_000)
            pipe.incr(keys.lease_epoch)
            pipe.hget(keys.worker_account, "steps")
            pipe.get(keys.heartbeat)
            taken = [int(pipe.execute()[2] or 0)]
            hb = real_redis.get(keys.heartbeat)
        try:
            w.run_once(flush=False, here=here)
        except LeaseLost:
            break
    else:
        raise AssertionError("the worker never noticed the takeover")
    with contextlib.suppress(LeaseLost):
        w.flush()
    assert taken and int(real_redis.hget(keys.worker_account, "steps") or 0) == taken[0]
    assert real_redis.get(keys.heartbeat) == hb


def test_the_overlap_is_used_only_while_fused_calls_are_short(real_redis: redis.Redis) -> None:
    """overlap_max_call_ms: after a fused call longer than it, the call runs in the loop's thread, its reads and
    filing still on the I/O thread (overlap_io), or everything in line (overlap_io off); 0: always overlap."""
    overlapped, here, in_line = {"flush": False}, {"flush": False, "here": True}, {"flush": True}
    for step_s, limit, io, expect in ((0.03, 20.0, True, here), (0.03, 20.0, False, in_line),
                                      (0.03, 0.0, True, overlapped), (0.0, 20.0, True, overlapped)):
        wid = f"ov{next(_runs)}"
        w = _worker(real_redis, wid, overlap=True, step_s=step_s, overlap_max_call_ms=limit, overlap_io=io)
        d = Driver(real_redis, w, wid, [Plan(0, (5, 6), 3, False, None, False)])
        assert w._mode() == overlapped  # before any call
        for it in range(50):
            d.tick(it)
            w.run_once(**w._mode())
            if w.stats.fused_calls:
                break
        w.flush()
        assert w._mode() == expect
    off = _worker(real_redis, f"ov{next(_runs)}", overlap=False, overlap_max_call_ms=0.0)
    assert off._mode() == in_line


def _three_sessions(client: redis.Redis, w: Worker, wid: str, **mode: bool) -> None:
    """Three sessions of 12 tokens under continuation credit (the Producer's, 8 a job) through `w`, its iterations
    run_once(**mode), until they finish."""
    p = Producer(client, decode_n=8, timeout_s=30.0)
    route = (RouteHop(worker_id=wid, key=w.keys["prefill"]),)  # type: ignore[index]
    hs = [p.open(SessionSpec(session_id=f"{wid}-{i}", account_id="a", route=route, max_tokens=12), [5, 6, 7])
          for i in range(3)]
    for _ in range(600):
        if all(h.finished for h in hs):
            break
        w.run_once(**mode)
        p.poll(hs)
    w.flush()
    assert all(h.status == "finished" for h in hs)


def _gaps(client: redis.Redis, overlap: bool, chain: bool) -> dict[float, float]:
    """The mean engine gap of three sessions under continuation credit, with the sampler as it is and slowed by
    20 ms a call."""
    means = {}
    for delay in (0.0, 0.02):
        wid = f"ov{next(_runs)}"
        w = _worker(client, wid, overlap=overlap, step_s=0.03, chain=chain)
        sampler = w.lanes[0].sampler
        sample = sampler.sample

        def slow(*a: object, _delay: float = delay, _sample: object = sample, **k: object) -> object:
            time.sleep(_delay)
            return _sample(*a, **k)  # type: ignore[operator]

        sampler.sample = slow  # type: ignore[method-assign]
        _three_sessions(client, w, wid, flush=not overlap)
        st = w.stats
        assert 0 < st.engine_gaps < st.fused_calls
        means[delay] = st.engine_gap_seconds / st.engine_gaps
        exposed = w.metrics.engine_gap.labels(wid)._sum.get()  # type: ignore[attr-defined]
        assert exposed == pytest.approx(st.engine_gap_seconds)
    return means


@pytest.mark.parametrize("overlap", [True, False])
def test_the_engine_gap_is_the_engine_idle_between_calls_the_loop_had_ready(real_redis: redis.Redis,
                                                                            overlap: bool) -> None:
    """stats.engine_gaps / engine_gap_seconds (and dgr_engine_gap_seconds): from a call's end (on the engine
    thread, or in the loop's thread with overlap off) to the next call's start, counted when the loop ran that
    one in the iteration after the first. Sessions under continuation credit (calls back to back, not chained): a
    sampler slowed by 20 ms puts at least that in every gap; without it the gap is far below the 30 ms call,
    which is never in it."""
    means = _gaps(real_redis, overlap, chain=False)
    assert means[0.02] >= 0.02 and means[0.0] < 0.03, means


def test_a_chained_call_does_not_wait_for_the_sampler(real_redis: redis.Redis) -> None:
    """With calls chained on the engine thread (consumer/worker/chain.py) the loop samples call k while k+1
    computes: a sampler slowed by 20 ms is in the gaps only where the chain breaks (a job or a session ends), so
    the mean gap stays well under the 20 ms it adds to every gap unchained (the test above)."""
    means = _gaps(real_redis, True, chain=True)
    assert means[0.02] < 0.01, means


class Guarded(SleepEngine):
    """Counts the times the engine is entered while it computes (a call, or a slot release, during a call)."""

    def __init__(self, step_s: float = 0.002) -> None:
        super().__init__(step_s, n_slots=8, ctx_per_session=256)
        self.inside = threading.Lock()
        self.clashes = 0
        self.threads: set[str] = set()

    def step(self, batch):  # type: ignore[no-untyped-def]
        if not self.inside.acquire(blocking=False):
            self.clashes += 1
            return super().step(batch)
        try:
            self.threads.add(threading.current_thread().name)
            return super().step(batch)
        finally:
            self.inside.release()

    def release(self, slot: int) -> None:
        if not self.inside.acquire(blocking=False):
            self.clashes += 1
            return
        self.inside.release()


class Lending(Guarded):
    """Lends its rows as the llama.cpp engine does (`forward_lent`: EngineOutput.borrowed, valid until the next call),
    and turns the last call's rows to NaN as each call starts: whoever reads rows after the next call started reads
    no token it could take."""

    def __init__(self) -> None:
        super().__init__()
        self.lent: np.ndarray | None = None

    def forward_lent(self, batch: FusedBatch) -> EngineOutput:
        if self.lent is not None:
            self.lent[...] = np.nan
        self.lent = self.forward(batch).rows
        return EngineOutput.logits(self.lent, borrowed=True)


def test_one_call_in_flight_and_slots_released_only_between_calls(real_redis: redis.Redis) -> None:
    """Overlap on, fused calls on the engine thread: the engine is never entered twice at once (a call and
    another call, or a call and a slot release: sessions cancelled and finished while calls compute),
    calls start in the loop's order, and every session still ends as with the loop alone."""
    wid = f"ov{next(_runs)}"
    engine = Guarded()
    w = Worker(engine, RedisTransport(real_redis, wid, consumer_name=wid),
               WorkerSettings(worker_id=wid, block_ms=1, gather_ms=0.0, await_ms=0, max_batch=8, overlap=True))
    w.start()
    plans = [Plan(i % 3, (5 + i, 6, 7), 6, i % 2 == 0, 2 if i % 3 == 0 else None, i % 2 == 1) for i in range(8)]
    d = Driver(real_redis, w, wid, plans)
    _run_until_settled(d, w, flush=False)
    d.tick(10_000)
    assert d.settled() and engine.clashes == 0
    assert engine.threads and all(name.startswith("dgr-engine") for name in engine.threads)  # the calls ran there
    seen_off, _ = _drive(real_redis, plans, overlap=False)
    assert {i: [(r.status, r.reason, r.position, r.token, r.finished) for r in rs] for i, rs in d.seen.items()} == \
           {i: [row[:5] for row in rs] for i, rs in seen_off.items()}


def test_a_replay_that_supersedes_an_attempt_waits_for_the_call_in_flight(real_redis: redis.Redis) -> None:
    """A route's replay re-opens a waiting session (attempts 1, 2, 3 at position 0) while the worker decodes
    three others under continuation credit, overlap on: admission drops the older attempt and clears its slot
    at once (so a full worker can re-open it), which it may do only once the call computing meanwhile has
    ended (a slot release during a call is a second thread in llama.cpp's context: 3 clashes without the
    wait). Each new attempt is answered with a token."""
    wid = f"ov{next(_runs)}"
    engine = Guarded(0.01)
    w = Worker(engine, RedisTransport(real_redis, wid, consumer_name=wid),
               WorkerSettings(worker_id=wid, block_ms=1, gather_ms=0.0, await_ms=0, max_batch=8, overlap=True))
    w.start()
    d = Driver(real_redis, w, wid, [])
    prompt = (5, 6, 7)

    def opening(i: int, attempt: int) -> StepJob:
        spec = SessionSpec(session_id=d.sid(i), account_id="acct", route=(RouteHop(worker_id=wid, key=d.key),),
                           sampling=Sampling(), max_tokens=200)
        return StepJob(job_id=job_id(d.sid(i), 0, "prefill", 0, attempt), session_id=d.sid(i), phase="prefill",
                       compat=d.key.digest, start_position=0, tokens=prompt, created_at=time.time(), session=spec,
                       attempt=attempt)

    def credit(i: int, attempt: int) -> StepJob:  # the session's next 64 tokens, fed its own last one each
        return StepJob(job_id=job_id(d.sid(i), 0, "decode", 3, attempt), session_id=d.sid(i), phase="decode",
                       compat=d.key.for_phase("decode").digest, start_position=3, tokens=(), n=64,
                       created_at=time.time(), attempt=attempt, with_opening=True)

    for i in range(4):
        d.push(opening(i, 0))
        if i:  # s0 waits for its next step after its first token (its route's next hop lost it, say)
            d.push(credit(i, 0))
    reopened = []
    for it in range(60):
        if it in (10, 20, 30):  # while the others decode: s0 replayed (attempts 1, 2, 3)
            job = opening(0, it // 10)
            d.push(job)
            reopened.append(job.job_id)
        w.run_once(flush=False)
    w.flush()
    answered = {r.job_id: r for i in range(4) for _, f in real_redis.xrange(d.keys.results(d.sid(i)))
                for r in results_from_fields(f)}
    assert engine.clashes == 0
    assert all(answered[j].token is not None for j in reopened), [answered.get(j) for j in reopened]


def test_every_fused_call_runs_on_one_thread_whether_it_overlaps_or_not(real_redis: redis.Redis) -> None:
    """llama.cpp's OpenMP keeps a team of threads per thread that calls it, and a second team makes libgomp
    stop spinning (calls slower for the rest of the process): with overlap on, every call runs on the
    engine thread, those that overlap and those that do not (calls longer than overlap_max_call_ms turn
    the overlap off until a short one turns it back on), retries after a failed call included; every
    session still ends as with the loop alone."""
    class Recording(SleepEngine):
        def __init__(self) -> None:
            super().__init__(0.001, n_slots=8, ctx_per_session=256)
            self.threads: set[str] = set()
            self.n = 0

        def step(self, batch):  # type: ignore[no-untyped-def]
            self.threads.add(threading.current_thread().name)
            self.n += 1
            self.step_s = 0.025 if self.n % 3 == 0 else 0.001  # past overlap_max_call_ms every third call
            if self.n == 4 and batch.n_logit_rows > 1:
                raise RuntimeError("one failed call: retried by halves")
            return super().step(batch)

    wid = f"ov{next(_runs)}"
    engine = Recording()
    w = Worker(engine, RedisTransport(real_redis, wid, consumer_name=wid),
               WorkerSettings(worker_id=wid, block_ms=1, gather_ms=0.0, await_ms=0, max_batch=8, overlap=True,
                              overlap_max_call_ms=20.0))
    w.start()
    plans = [Plan(i % 3, (5 + i, 6, 7), 6, i % 2 == 0, None, False) for i in range(6)]
    d = Driver(real_redis, w, wid, plans)
    kinds: dict[bool, int] = {False: 0, True: 0}  # iterations overlapped, and with the call in the loop's thread
    for it in range(600):
        d.tick(it)
        mode = w._mode()
        kinds[mode.get("here", False)] += 1
        w.run_once(**mode)
        if it > 6 and d.settled():
            break
    w.flush()
    d.tick(10_000)
    assert d.settled() and kinds[False] and kinds[True]  # both kinds of iteration ran
    assert engine.n > 4 and len(engine.threads) == 1 and next(iter(engine.threads)).startswith("dgr-engine")
    seen_off, _ = _drive(real_redis, plans, overlap=False)
    assert {i: [(r.status, r.reason, r.position, r.token, r.finished) for r in rs] for i, rs in d.seen.items()} == \
           {i: [row[:5] for row in rs] for i, rs in seen_off.items()}


def test_the_compute_thread_is_one_thread_for_the_process() -> None:
    """Engines built and called through it meet one thread (and one OpenMP team); a call from it runs inline."""
    from consumer.engines.compute import compute_thread, on_compute_thread

    names = {on_compute_thread(lambda: threading.current_thread().name) for _ in range(5)}
    names |= {compute_thread().submit(lambda: threading.current_thread().name).result()}
    assert len(names) == 1 and next(iter(names)).startswith("dgr-engine")
    assert on_compute_thread(lambda: on_compute_thread(lambda: 7)) == 7  # no deadlock from the thread itself


def test_the_consumer_builds_its_engines_on_the_compute_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dgr consumer` builds its engines on the thread its fused calls run on (overlap on: one OpenMP team
    for llama.cpp), and on its own thread with overlap off (where it calls them)."""
    from typer.testing import CliRunner

    import consumer.cli as cli
    import consumer.runtime as runtime

    built_on: list[str] = []

    def record(*a: object, **kw: object) -> None:
        built_on.append(threading.current_thread().name)
        raise ValueError("engines recorded, stop here")  # a bad --model: the CLI exits 2 before Redis

    monkeypatch.setattr(runtime, "make_engines", record)  # the CLI imports it when it runs
    for flag, on_compute in (("--overlap", True), ("--no-overlap", False)):
        res = CliRunner().invoke(cli.app, ["consumer", "--redis-url", "redis://127.0.0.1:1/0", "--worker-id", "w",
                                           "--model", "tiny", flag])
        assert res.exit_code == 2, res.output
        assert built_on[-1].startswith("dgr-engine") is on_compute, built_on


chained_plans = st.lists(st.tuples(st.integers(1, 14), st.sampled_from([False, False, False, True]),
                                   st.none() | st.integers(0, 10)), min_size=1, max_size=6)


@settings(max_examples=30 if SOAK else 4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=chained_plans, decode_n=st.integers(1, 5))
def test_chained_calls_change_no_result_and_no_account(real_redis: redis.Redis,
                                                       sessions: list[tuple[int, bool, int | None]],
                                                       decode_n: int) -> None:
    """Decode calls chained on the engine thread (consumer/worker/chain.py) against the same worker unchained: the
    public Producer's continuation jobs (pushed ahead, its credit window), greedy and sampled sessions, cancels
    sent after some tokens. A session not cancelled gets the same tokens and ending; a cancelled one a prefix of
    its tokens; every session is charged the tokens it was given; the engine is never entered twice at once. The
    chained worker's engine lends its rows and spoils them when its next call starts (Lending): no call's rows are
    read after that."""
    got: dict[bool, tuple[dict[int, tuple[str, list[int]]], int]] = {}
    for chain in (False, True):
        wid = f"ov{next(_runs)}"
        engine = Lending() if chain else Guarded()
        w = Worker(engine, RedisTransport(real_redis, wid, consumer_name=wid),
                   WorkerSettings(worker_id=wid, block_ms=1, gather_ms=0.0, await_ms=0, max_batch=8, overlap=True,
                                  chain=chain))
        w.start()
        p = Producer(real_redis, decode_n=decode_n, timeout_s=30.0)
        route = (RouteHop(worker_id=wid, key=w.keys["prefill"]),)  # type: ignore[index]
        hs = [p.open(SessionSpec(session_id=f"{wid}-{i}", account_id=f"a{i % 2}", route=route, max_tokens=m,
                                 sampling=Sampling(temperature=0.8, top_k=40, seed=i) if sampled else Sampling()),
                     [5 + i, 6, 7]) for i, (m, sampled, _) in enumerate(sessions)]
        cancelled: set[int] = set()
        for _ in range(3000):
            if all(h.finished for h in hs):
                break
            w.run_once(flush=False)
            p.poll(hs)
            for i, (h, (_, _, after)) in enumerate(zip(hs, sessions, strict=True)):
                if after is not None and i not in cancelled and not h.finished and len(h.generated) >= after:
                    p.cancel_route(h)
                    cancelled.add(i)
        w.flush()
        assert all(h.finished for h in hs) and engine.clashes == 0
        keys = WorkerKeys(wid)
        for h in hs:
            acct = real_redis.hgetall(keys.session_account(h.session_id))
            assert int(acct.get(b"generated_tokens", 0)) == len(h.generated), h
        assert w.scheduler.stats.sessions_failed == 0  # none lost to a chained row handed out wrong (adopt)
        got[chain] = ({i: (h.status, list(h.generated)) for i, h in enumerate(hs)},
                      w.stats.calls_by_iteration["chained"])
    (off, unchained), (on, _) = got[False], got[True]
    assert unchained == 0
    for i, (_, _, after) in enumerate(sessions):
        if after is None:
            assert on[i] == off[i], i
        else:
            short, long = sorted((on[i][1], off[i][1]), key=len)
            assert long[:len(short)] == short, i


def test_greedy_sessions_under_credit_are_chained(real_redis: redis.Redis) -> None:
    """Not vacuous: four greedy sessions of 12 tokens under continuation credit have calls chained."""
    wid = f"ov{next(_runs)}"
    w = _worker(real_redis, wid, overlap=True, step_s=0.002)
    p = Producer(real_redis, decode_n=4, timeout_s=30.0)
    route = (RouteHop(worker_id=wid, key=w.keys["prefill"]),)  # type: ignore[index]
    hs = [p.open(SessionSpec(session_id=f"{wid}-{i}", account_id="a", route=route, max_tokens=12), [5, 6, i])
          for i in range(4)]
    for _ in range(2000):
        if all(h.finished for h in hs):
            break
        w.run_once(flush=False)
        p.poll(hs)
    w.flush()
    assert all(h.status == "finished" and len(h.generated) == 12 for h in hs)
    assert w.stats.calls_by_iteration["chained"] >= 4, w.stats.calls_by_iteration


@pytest.mark.parametrize("here", [True, False], ids=["loop-thread", "engine-thread"])
def test_the_engine_gap_counts_the_first_cut_and_the_hand_overs(real_redis: redis.Redis, here: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's idle and its time are the engine call's own, read on the thread that ran it: the first cut
    after it (20 ms here, on the compute thread), the hand-over back to the loop and the next call's hand-over
    (and the waits for the GIL in them: 0.4-0.8 ms a call measured with Gemma in the loop's thread) are idle, not
    engine time. Calls of 30 ms, sessions under continuation credit, not chained."""
    import consumer.worker.chain as chain

    cut = chain.first_cut
    monkeypatch.setattr(chain, "first_cut", lambda out, batch: time.sleep(0.02) or cut(out, batch))
    wid = f"ov{next(_runs)}"
    w = _worker(real_redis, wid, overlap=True, step_s=0.03, chain=False)
    _three_sessions(real_redis, w, wid, flush=False, here=here)
    st = w.stats
    assert 0 < st.engine_gaps < st.fused_calls
    assert st.engine_gap_seconds / st.engine_gaps >= 0.02
    assert 0.03 <= st.engine_seconds / st.fused_calls < 0.045  # the 30 ms step and its overrun, not the cut's 20 ms
