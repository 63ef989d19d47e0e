"""Continuation jobs (StepJob.n > 1) searched for counterexamples: the producer's credit window
(producer/steps.py `queue_next`, session.py `Credit`) and the worker (scheduler, delivery rules) against each
session run alone.

The engine here keeps, per slot, a hash of every (position, token) row it was fed and answers a logits
row whose argmax is that hash: a token fed at a wrong position, a wrong token, a row fed twice or left
out changes every later token, so the session's tokens equal `oracle`'s only if the worker fed exactly
the rows the session alone would have had. No Redis here (the in-memory transport, the completion
script's first-answer rule mirrored): tests/test_continuation_e2e.py runs the same on real Redis.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from consumer.batch import FusedBatch
from consumer.sampling import argmax_rows, sample
from consumer.transport.protocol import Delivery, Inbound
from consumer.worker import Worker, WorkerSettings
from producer import ProducerCore, SessionHandle
from producer.commands import Batch, XAdd
from schemas import Reason, RouteHop, Sampling, SessionSpec, Status, StepJob, StepResult, job_from_fields
from schemas.step import end_job_id, result_job_id
from schemas.wire import split_result_id
from tests.doubles.null import NullEngine
from tests.memory_transport import MemoryTransport

SOAK = os.environ.get("DGR_SOAK") == "1"
VOCAB = 64
WID = "w-cont"
_ids = itertools.count()


def _mix(h: int, position: int, token: int) -> int:
    return (h * 1_000_003 + position * 8191 + token * 131 + 7) % (1 << 61)


class HistoryEngine(NullEngine):
    """Logits: a one-hot row at (hash of the slot's rows so far) mod vocab. Rows out of order are recorded."""

    def __init__(self, n_slots: int, wrong: Callable[[int, int], bool] | None = None) -> None:
        super().__init__(n_slots=n_slots, ctx_per_session=4096, vocab_size=VOCAB)
        self.state: dict[int, tuple[int, int]] = {}  # slot -> (next position, hash)
        self.errors: list[str] = []
        self.wrong = wrong  # wrong(slot, position): this row's logits peak one token off (a broken promise)

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        out = []
        for slot, pos, tok, wants in zip(batch.slots.tolist(), batch.positions.tolist(), batch.tokens.tolist(),
                                         batch.wants_logits.tolist(), strict=True):
            nxt, h = self.state.get(slot, (0, 0))
            if pos != nxt:
                self.errors.append(f"slot {slot}: row at position {pos}, expected {nxt}")
            h = _mix(h, pos, tok)
            self.state[slot] = (pos + 1, h)
            if wants:
                out.append((h + 1) % VOCAB if self.wrong is not None and self.wrong(slot, pos) else h % VOCAB)
        logits = np.zeros((len(out), VOCAB), np.float32)
        logits[np.arange(len(out)), out] = 4.0
        return logits

    def release(self, slot: int) -> None:
        self.state.pop(slot, None)


@dataclass(frozen=True)
class Sess:
    prompt: tuple[int, ...]
    max_tokens: int
    n: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_at: int | None = None  # the oracle's token number stop_at is a stop token
    cancel_after: int | None = None  # cancel once this many tokens arrived
    dup_every: int | None = None  # re-push a continuation job every this many results


def oracle(s: Sess, stops: tuple[int, ...] = ()) -> list[int]:
    """The session alone: prompt rows, then one row per token, the same sampler keyed by position."""
    h = 0
    for i, t in enumerate(s.prompt):
        h = _mix(h, i, t)
    pos, out = len(s.prompt), []
    while True:
        row = np.zeros(VOCAB, np.float32)
        row[h % VOCAB] = 4.0
        t = int(argmax_rows(row[None])[0]) if s.sampling.greedy else sample(row, s.sampling, pos)
        out.append(t)
        if len(out) >= s.max_tokens or t in stops:
            return out
        h = _mix(h, pos, t)
        pos += 1


@dataclass
class Run:
    handles: dict[str, SessionHandle]
    published: dict[str, StepResult]  # result id -> the first answer (what Redis keeps)
    order: list[StepResult]  # first answers in publication order
    again: list[tuple[StepResult, StepResult]]  # (first, later answer under the same id)
    unacked: list[Delivery]
    engine_errors: list[str]
    cancelled: set[str]
    stops: dict[str, tuple[int, ...]]
    crashed: bool = False
    extra: dict[str, int] = field(default_factory=dict)
    told: dict[str, list[int]] = field(default_factory=dict)  # the tokens a caller's callback would get, in order
    # (session, attempt) whose replay sampled a token the session had differently (`diverge`): its answers are
    # the lost attempt's, left out of the checks by position
    diverged: set[tuple[str, int]] = field(default_factory=set)
    attempts: dict[str, int] = field(default_factory=dict)  # job id -> its attempt


def run(sessions: list[Sess], n_slots: int, max_batch: int, crash_at: int | None = None, ramp: bool = False,
        max_iterations: int = 5_000, prefill_budget: int = 512, hold: int | None = None,
        diverge: bool = False, outages: tuple[tuple[int, int], ...] = ()) -> Run:
    """Drive the sessions through ProducerCore (credit) and a Worker on the in-memory transport. A crash
    (after the iteration's completion) replaces worker and engine; entries read and not acked are handed
    out again, as the transport's recovery does. The early hold (consumer/worker/early.py) runs on a clock of one
    second an iteration and lasts `hold` of them (default 10; a small `prefill_budget` keeps the reader from the
    prefill stream meanwhile): on the wall clock a run that needs a hold to expire (a crash after a session's
    opening was answered and before its ramped continuation was: the new worker holds that continuation for an
    opening that never comes again) would end before it does. `diverge`: the engine after the crash breaks its
    promise once, on the first row that samples again a token a replayed session had (its Tracker loses that
    attempt and replays it feeding the tokens as prompt: docs/invariance.md, item 4). `outages`: (iteration, k)
    each, a Redis outage after that iteration: the read in flight loses its reply (the first k entries of each
    stream, handed out again first at the next read, as the transport does: consumer/transport/intake.py
    `unreplied`) and the Tracker re-pushes every job it has unanswered (as `Producer` does when Redis is back)."""
    t = MemoryTransport()
    engines: list[HistoryEngine] = []
    cfg = WorkerSettings(worker_id=WID, max_batch=max_batch, block_ms=0, gather_ms=0.0, await_ms=0,
                         prefill_budget=prefill_budget, early_hold_s=float(hold or 10), early_hold_max_s=1e9)
    clock = [0.0]
    workers: list[Worker] = []

    injected: list[str] = []

    def wrong(slot: int, pos: int) -> bool:
        sid = workers[-1].lanes[0].scheduler.table.session_at(slot)
        h = handles.get(sid or "")
        if injected or h is None or h.attempt == 0:
            return False
        g = pos + 1 - len(by_sid[h.session_id].prompt)  # the token this row samples, among the generated
        if 0 <= g < len(h.regenerate):
            injected.append(h.session_id)
            return True
        return False

    def new_worker() -> Worker:
        engines.append(HistoryEngine(n_slots, wrong if diverge and workers else None))
        w = Worker(engines[-1], t, cfg)
        w.admission.clock = lambda: clock[0]
        w.start()
        workers.append(w)
        return w

    w = new_worker()
    core = ProducerCore(verify_route=False, prefill_chunk=7)
    entries: dict[str, Inbound] = {}
    acked: set[str] = set()

    def send(batch: Batch) -> None:
        ops = batch.ops
        if ramp:  # a session's first continuation read before its prompt (consumer/worker/early.py holds it)
            ops = sorted(ops, key=lambda op: not (isinstance(op, XAdd) and op.stream.endswith(":decode")))
        for op in ops:
            if isinstance(op, XAdd) and not op.stream.endswith(":cancel"):  # a cancel's event is not a job
                job = job_from_fields(op.fields)
                attempts[job.job_id] = job.attempt
                d = t.push(job)
                entries[d.entry_id] = t.queues[d.stream][-1]

    stops: dict[str, tuple[int, ...]] = {}
    attempts: dict[str, int] = {}
    diverged: set[tuple[str, int]] = set()
    handles: dict[str, SessionHandle] = {}
    by_sid: dict[str, Sess] = {}
    for i, s in enumerate(sessions):
        sid = f"s{i}-{next(_ids)}"
        full = oracle(s)
        stops[sid] = (full[s.stop_at],) if s.stop_at is not None and s.stop_at < len(full) else ()
        spec = SessionSpec(session_id=sid, account_id="acct", route=(RouteHop(worker_id=WID, key=w.keys["prefill"]),),
                           max_tokens=s.max_tokens, stop_tokens=stops[sid], sampling=s.sampling)
        h = core.new_handle(spec, s.prompt, 0)
        h.credit.n = s.n  # what tokens_per_job gives against a worker that advertises continuation
        b = Batch()
        core.queue_prefill(b, h, ramp=ramp)
        send(b)
        handles[sid], by_sid[sid] = h, s
    published: dict[str, StepResult] = {}
    order: list[StepResult] = []
    again: list[tuple[StepResult, StepResult]] = []
    cancelled: set[str] = set()
    told: dict[str, list[int]] = {}
    seen = 0
    seen_by: dict[str, int] = dict.fromkeys(handles, 0)
    crashed = False
    unreplied: list[tuple[int, str, list[Inbound]]] = []  # (due iteration, stream, entries whose reply was lost)
    for it in range(max_iterations):
        if all(h.finished for h in handles.values()) and not unreplied:
            break
        for stream in {u[1] for u in unreplied if u[0] <= it}:  # handed out again first, in stream order
            xs = sorted((x for u in unreplied if u[0] <= it and u[1] == stream for x in u[2]),
                        key=lambda x: int(x.ref.entry_id))
            t.queues[stream].extendleft(reversed(xs))
        unreplied = [u for u in unreplied if u[0] > it]
        clock[0] += 1.0
        w.run_once()
        for a in t.answers[seen:]:  # what the completion acked (with the results, in one script)
            if isinstance(a.ref, Delivery) and a.final:
                acked.add(a.ref.entry_id)
        acked.update(d.entry_id for d in t.acked)  # acked without an answer (answered by an earlier process)
        if crash_at is not None and it == crash_at and not crashed:
            crashed = True
            unreplied = []  # the new worker's recovery claims them with the rest below
            w = new_worker()  # kill -9 after the completion: the engine state is gone
            read = [entries[e] for e in entries if e not in acked]
            queued = {id(x) for q in t.queues.values() for x in q}
            lost = [x for x in read if id(x) not in queued and x.ref.entry_id not in acked]
            for stream in list(t.queues):
                t.queues[stream] = deque([x for x in lost if x.ref.stream == stream] + list(t.queues[stream]))
        batch = Batch()
        for a in t.answers[seen:]:
            ref = a.ref
            assert isinstance(ref, Delivery)
            if a.final:
                acked.add(ref.entry_id)
            r = a.result
            first = published.get(r.job_id)
            if first is not None:
                again.append((first, r))
                continue
            published[r.job_id] = r
            order.append(r)
            h = handles[r.session_id]
            s = by_sid[r.session_id]
            # as ProducerCore.ingest passes answers on: applied, and not a token a replay sampled again
            was = h.diverged
            if core.apply(h, r) and not h.echo and r.status == Status.OK and r.token is not None:
                told.setdefault(r.session_id, []).append(r.token)
            if h.diverged and not was:
                diverged.add((r.session_id, attempts[split_result_id(r.job_id)[0]]))
            seen_by[r.session_id] += 1
            if s.cancel_after is not None and r.session_id not in cancelled and len(h.generated) >= s.cancel_after:
                cancelled.add(r.session_id)
                t.cancel(r.session_id)
            if s.dup_every and seen_by[r.session_id] % s.dup_every == 0 and h.credit.jobs:
                core.xadd(batch, h, h.sent[next(iter(h.credit.jobs))])  # a twice-pushed continuation
        seen = len(t.answers)
        for _at, k in [o for o in outages if o[0] == it]:
            for stream, q in t.queues.items():
                lost = [q.popleft() for _ in range(min(k, len(q)))]
                if lost:
                    unreplied.append((it + 1, stream, lost))
            for h in handles.values():
                core.queue_unanswered(batch, h)
        for sid, h in handles.items():
            core.advance(batch, h, True, cancel_marked=sid in t.cancel_markers)
        send(batch)
    else:
        pytest.fail(f"not done after {max_iterations} iterations: "
                    + ", ".join(f"{h.session_id} {h.status} {len(h.generated)}" for h in handles.values()
                                if not h.finished))
    # drain: answers to the last pushes (a continuation pushed ahead of a stop, a duplicate) and acks, and the
    # steps still held early until their hold expires (the clock goes on)
    for _ in range(50):
        clock[0] += 1.0
        if not w.run_once() and not len(w.admission.early):
            break
    for a in t.answers[seen:]:
        ref = a.ref
        assert isinstance(ref, Delivery)
        if a.final:
            acked.add(ref.entry_id)
        if a.result.job_id in published:
            again.append((published[a.result.job_id], a.result))
        else:
            published[a.result.job_id] = a.result
            order.append(a.result)
    acked.update(d.entry_id for d in t.acked)  # acked without an answer during the drain too
    unacked = [x.ref for e, x in entries.items() if e not in acked]
    return Run(handles, published, order, again, unacked, [e for eng in engines for e in eng.errors],
               cancelled, stops, crashed, {"held": sum(x.stats.early_held for x in workers),
                                           "calls": sum(x.stats.fused_calls for x in workers),
                                           "injected": len(injected)}, told, diverged, attempts)


def check(sessions: list[Sess], r: Run) -> None:
    assert r.engine_errors == []
    by_sid = dict(zip(r.handles, sessions, strict=True))
    for sid, h in r.handles.items():
        s = by_sid[sid]
        want = oracle(s, r.stops[sid])
        got = list(h.generated)
        if sid in r.cancelled:
            assert got == want[:len(got)], (sid, got, want)
            assert h.status in ("cancelled", "finished"), (sid, h.status, h.reason, h.detail)
        else:
            assert (h.status, got) == ("finished", want), (sid, h.status, h.reason, h.detail, got, want)
        # its caller is told each token once, in order, a replay's tokens sampled again included
        assert r.told.get(sid, []) == got, (sid, r.told.get(sid), got)
        mine = [x for x in r.order if x.session_id == sid
                and (sid, r.attempts.get(split_result_id(x.job_id)[0], 0)) not in r.diverged]
        # one published result per token the session got, none after its last; a replay that samples the tokens
        # again (producer/steps.py `regenerates`) answers them again, the same token at each position
        by_position: dict[int, StepResult] = {}
        for x in mine:
            if x.status == Status.OK and x.token is not None:
                had = by_position.setdefault(x.position, x)
                assert had.token == x.token, (sid, x.position, had.job_id, x.job_id)
        tokens = [by_position[p] for p in sorted(by_position)]
        assert [x.token for x in tokens] == got, (sid, [x.job_id for x in tokens])
        # the worker's own count, one per token sampled: the first answer at each position (the completion
        # script charges a token sampled again below the session's high-water mark as recomputed: test_lua.py)
        assert sum(x.accounting.generated_tokens for x in tokens) == len(got)
        assert all(x.token is None or x.status == Status.OK for x in mine)
        ends = [i for i, x in enumerate(mine) if x.finished]
        if ends:
            after = mine[ends[0] + 1:]
            assert all(x.token is None and x.accounting.generated_tokens == 0 for x in after), after
            # a step pushed ahead of the stop and handed after a crash to a worker that never held the session is
            # answered state_lost (it cannot know another process finished it; the Tracker, done, ignores it)
            moot = (Reason.FINISHED, Reason.UNKNOWN_SESSION) if r.crashed else (Reason.FINISHED,)
            assert all(x.reason in moot for x in after), after
    # a redelivery or a twin answers under an id already answered the same way (the record stands)
    for first, later in r.again:
        assert (later.status, later.token) == (first.status, first.token) or later.reason == Reason.DUPLICATE, \
            (first, later)
    assert r.unacked == [], "every entry is acked once its job ended"


@st.composite
def sessions(draw: st.DrawFn) -> list[Sess]:
    out = []
    for _ in range(draw(st.integers(1, 5))):
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        out.append(Sess(
            prompt=tuple(int(x) for x in rng.integers(3, VOCAB, draw(st.integers(1, 20)))),
            max_tokens=draw(st.integers(1, 6) | st.integers(7, 40)),
            n=draw(st.sampled_from([1, 2, 3, 16])),
            sampling=draw(st.sampled_from([Sampling(), Sampling(temperature=0.9, seed=5)])),
            stop_at=draw(st.none() | st.integers(0, 39)),
            cancel_after=draw(st.none() | st.none() | st.integers(0, 30)),
            dup_every=draw(st.none() | st.integers(1, 5)),
        ))
    return out


@settings(max_examples=1000 if SOAK else 60, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ss=sessions(), extra_slots=st.integers(0, 3), max_batch=st.integers(1, 8),
       crash_at=st.none() | st.integers(0, 60), ramp=st.booleans())
def test_continuation_tokens_results_and_charges_equal_n1_alone(ss: list[Sess], extra_slots: int, max_batch: int,
                                                                 crash_at: int | None, ramp: bool) -> None:
    r = run(ss, len(ss) + extra_slots, max_batch, crash_at, ramp)
    check(ss, r)


@settings(max_examples=400 if SOAK else 40, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ss=sessions(), extra_slots=st.integers(0, 3), max_batch=st.integers(1, 8),
       crash_at=st.none() | st.integers(0, 60), budget=st.integers(2, 8), hold=st.integers(1, 4))
def test_ramped_continuations_survive_holds_shorter_than_their_prompts_take(
        ss: list[Sess], extra_slots: int, max_batch: int, crash_at: int | None, budget: int, hold: int) -> None:
    """Counterexample search for the early hold: every first continuation read before its prompt, a prefill
    budget of a few tokens (the reader takes no prompt entries while two calls' worth are queued), and a hold
    of 1-4 iterations, far shorter than the prompts take to be read: no session is replayed or refused for
    it, and every one gets its tokens alone (with crashes, cancels, stops and twice-pushed jobs drawn too)."""
    r = run(ss, len(ss) + extra_slots, max_batch, crash_at, ramp=True, prefill_budget=budget, hold=hold)
    check(ss, r)


@settings(max_examples=400 if SOAK else 40, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ss=sessions(), extra_slots=st.integers(0, 3), max_batch=st.integers(1, 8),
       crash_at=st.none() | st.integers(0, 60), budget=st.sampled_from([2, 4, 8, 512]), ramp=st.booleans(),
       outages=st.lists(st.tuples(st.integers(0, 8) | st.integers(0, 40), st.integers(0, 4)), min_size=1, max_size=3))
def test_continuations_survive_outages_that_lose_a_read_and_push_every_unanswered_job_again(
        ss: list[Sess], extra_slots: int, max_batch: int, crash_at: int | None, budget: int, ramp: bool,
        outages: list[tuple[int, int]]) -> None:
    """Counterexample search for Redis outages: a read whose reply is lost (its entries handed out again first at
    the next read) and a Tracker that re-pushes every job it has unanswered, at any point of the sessions' prompts
    and continuations: every job is answered once, every session gets its tokens alone (with crashes, cancels, stops
    and twice-pushed jobs drawn too). With the lost entries handed out a few reads later (as the ownership sweep did
    before `Intake.unreplied`) it found a re-pushed opening releasing a continuation held for the prompt's last
    chunk (refused position_gap: the kept case below), a continuation pushed ahead refused position_gap, and a
    prompt's later chunk answered state_lost (tests/test_lost_replies.py has those two on redis-server)."""
    r = run(ss, len(ss) + extra_slots, max_batch, crash_at, ramp, prefill_budget=budget, outages=tuple(outages))
    check(ss, r)


# ---- kept cases --------------------------------------------------------------------------------------

@settings(max_examples=600 if SOAK else 40, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ss=sessions(), extra_slots=st.integers(0, 3), max_batch=st.integers(1, 8), crash_at=st.integers(0, 40),
       ramp=st.booleans())
def test_a_replay_that_samples_a_token_wrong_is_replayed_exactly(ss: list[Sess], extra_slots: int, max_batch: int,
                                                                  crash_at: int, ramp: bool) -> None:
    """The crash search with an engine that, after the crash, samples once a token a replayed session had
    differently (docs/invariance.md, item 4): that attempt is lost, the next feeds the tokens as prompt, and every
    session still ends with its tokens alone, its caller told each once, the answers of the other attempts
    consistent by position (fails with the divergence check off: tests/test_replay_regenerate.py)."""
    r = run(ss, len(ss) + extra_slots, max_batch, crash_at, ramp, diverge=True)
    event(f"a replay diverged: {bool(r.diverged)}")
    assert len(r.diverged) <= r.extra["injected"] <= 1
    check(ss, r)


def test_a_diverged_replay_is_replayed_exactly_once_more() -> None:
    """The search above is not vacuous: a greedy session crashed mid-decode diverges at its first row sampled
    again and is replayed again, the tokens fed as prompt."""
    s = Sess(prompt=(3, 4, 5), max_tokens=30, n=4)
    r = run([s], 1, 4, crash_at=8, diverge=True)
    check([s], r)
    (h,) = r.handles.values()
    assert r.extra["injected"] == 1 and len(r.diverged) == 1 and h.diverged and h.attempt == 2, \
        (r.extra, r.diverged, h.attempt)


def test_a_twice_pushed_continuation_ended_before_a_crash_is_not_answered_again() -> None:
    """Found by the search above under DGR_SOAK=1: a session that stops at its first token ends its ramped
    continuation REJECTED (under `<job>.end`); after a crash its twin reached the new worker, which had never
    held the session and answered it state_lost under the same id (`checks` looked for the job id's marker
    only; the completion script's marker kept the second answer from being published). Now known as answered."""
    ss = [Sess(prompt=(54, 41, 34, 19, 21, 5, 7, 4), max_tokens=7, n=2, stop_at=0, dup_every=1),
          Sess(prompt=(54,), max_tokens=1, n=1)]
    r = run(ss, 2, 1, crash_at=1, ramp=True)
    check(ss, r)  # its twin is acked with no new answer (r.unacked is empty)
    assert r.crashed


def test_continuation_decodes_without_a_new_job_and_ids_are_derived() -> None:
    s = Sess(prompt=(5, 6, 7), max_tokens=40, n=16)
    r = run([s], 1, 4)
    check([s], r)
    ids = [x.job_id for x in r.order if x.token is not None]
    assert len(ids) == 40 and len(set(ids)) == 40
    sizes: dict[str, int] = {}
    for j in ids:  # offset 0 keeps the job's own id; offset k is "<job id>.<k>"
        base = j.split(".")[0]
        sizes[base] = sizes.get(base, 0) + 1
        assert j == result_job_id(base, sizes[base] - 1)
    # the prefill's token, then decode jobs of 16, 16 and 7: never past max_tokens, so no credit is left over
    assert list(sizes.values()) == [1, 16, 16, 7]


def test_first_continuation_read_before_its_prompt_is_held_and_decodes_at_the_next_call() -> None:
    """The ramp: the first continuation goes with the opening; read first, it is held (not answered state_lost)
    and fed the prompt's token at the call after the prefill, so the session needs no second push to start."""
    s = Sess(prompt=(5, 6, 7, 8, 9, 10, 11, 12, 13), max_tokens=6, n=8)  # two prompt chunks of 7
    r = run([s], 1, 4, ramp=True)
    check([s], r)
    assert r.extra["held"] == 1
    assert r.extra["calls"] == 2 + 5  # the prompt's two chunks, then one decode call per further token


def test_stop_mid_continuation_drops_the_rest_of_the_credit_uncharged() -> None:
    s = Sess(prompt=(9, 8), max_tokens=40, n=16, stop_at=5)
    r = run([s], 1, 4)
    check([s], r)
    (h,) = r.handles.values()
    assert len(h.generated) == 6 and h.status == "finished"
    assert sum(x.accounting.generated_tokens for x in r.order) == 6


def test_cancel_between_continuations_ends_the_session_with_a_prefix() -> None:
    for after in (1, 8, 9, 17):
        s = Sess(prompt=(3, 4, 5, 6), max_tokens=40, n=8, cancel_after=after)
        r = run([s], 1, 4)
        check([s], r)
        (h,) = r.handles.values()
        assert h.status in ("cancelled", "finished") and len(h.generated) >= after


def test_duplicate_push_of_a_continuation_yields_one_result_per_offset() -> None:
    s = Sess(prompt=(3, 4), max_tokens=30, n=4, dup_every=1)
    r = run([s], 1, 2)
    check([s], r)
    assert r.again, "the duplicates were answered (acked) under ids already answered"


def test_crash_mid_continuation_is_answered_state_lost_under_the_end_id_and_replayed() -> None:
    s = Sess(prompt=(3, 4, 5), max_tokens=30, n=16)
    r = run([s], 1, 4, crash_at=5)
    check([s], r)
    (h,) = r.handles.values()
    assert r.crashed and h.attempt == 1
    lost = [x for x in r.order if x.status == Status.STATE_LOST]
    assert lost and all(x.job_id.endswith(".end") for x in lost)


def test_result_ids() -> None:
    assert result_job_id("abc", 0) == "abc" and result_job_id("abc", 3) == "abc.3"
    assert end_job_id("abc") == "abc.end"
    with pytest.raises(ValueError):
        result_job_id("abc", -1)


def test_schema_rules_for_n() -> None:

    from schemas import job_to_fields
    from schemas.step import MAX_CONTINUATION_JOB_ID

    base = dict(session_id="s", phase="decode", compat="0" * 16, start_position=4, created_at=1.0)
    j = StepJob(job_id="j", tokens=(), n=16, **base)  # type: ignore[arg-type]
    assert j.end_position == 20 and job_from_fields(job_to_fields(j)) == j
    one = StepJob(job_id="j", tokens=(1,), **base)  # type: ignore[arg-type]
    assert "n" not in job_to_fields(one)  # n = 1: the entry is the same as before continuation jobs
    assert one.answer_id(0, ok=False) == "j" and j.answer_id(0, ok=False) == "j.end"
    assert j.answer_id(0, ok=False, duplicate=True) == "j"
    with pytest.raises(ValueError):
        StepJob(job_id="x" * (MAX_CONTINUATION_JOB_ID + 1), tokens=(1,), n=2, **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StepJob(job_id="j", tokens=(1,), n=65, **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StepJob(job_id="j", session_id="s", phase="prefill", compat="0" * 16, start_position=4, created_at=1.0,
                tokens=(1,), n=2)


def _worker(n_slots: int = 2) -> tuple[Worker, MemoryTransport]:
    t = MemoryTransport()
    w = Worker(HistoryEngine(n_slots), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0))
    w.start()
    return w, t


def _open(w: Worker, sid: str, route_len: int = 1, sample: bool = True) -> StepJob:
    hop = RouteHop(worker_id=WID, key=w.keys["prefill"])
    spec = SessionSpec(session_id=sid, account_id="a", route=(hop,) * route_len, max_tokens=30)
    return StepJob(job_id=f"{sid}-open", session_id=sid, phase="prefill", compat=w.keys["prefill"].digest,
                   start_position=0, tokens=(3, 4, 5), sample=sample, created_at=1.0, session=spec)


def _decode(w: Worker, sid: str, pos: int, tokens: tuple[int, ...], n: int, tag: str = "") -> StepJob:
    return StepJob(job_id=f"{sid}-d{pos}{tag}", session_id=sid, phase="decode", compat=w.keys["decode"].digest,
                   start_position=pos, tokens=tokens, created_at=1.0, n=n)


def test_a_route_of_several_hops_refuses_n_above_one() -> None:
    w, t = _worker()
    t.push(_open(w, "mh", route_len=2))
    w.run_once()
    token = t.answers[-1].result.token
    assert token is not None
    t.push(_decode(w, "mh", 3, (token,), 4))
    w.run_once()
    r = t.answers[-1].result
    assert (r.status, r.reason, r.job_id) == (Status.REJECTED, Reason.WRONG_HOP, "mh-d3.end")
    t.push(_decode(w, "mh", 3, (token,), 1))  # n = 1 is served on any route
    w.run_once()
    assert t.answers[-1].result.status == Status.OK


def test_producer_keeps_n_1_on_a_route_of_several_hops() -> None:
    from producer.steps import tokens_per_job

    w, _ = _worker()
    core = ProducerCore(verify_route=False, decode_n=16)
    spec = _open(w, "p2", route_len=2).session
    assert spec is not None
    h = SessionHandle(spec=spec, prompt=(3, 4, 5), worker_id=WID)
    assert tokens_per_job(core, h) == 1
    one = SessionHandle(spec=_open(w, "p1").session, prompt=(3, 4, 5), worker_id=WID)  # type: ignore[arg-type]
    assert tokens_per_job(core, one) == 1  # the worker was never discovered: it may not know n


def test_a_continuation_with_no_token_needs_a_sampled_token_before_it() -> None:
    w, t = _worker()
    t.push(_open(w, "gap", sample=False))
    w.run_once()
    t.push(_decode(w, "gap", 3, (), 4))
    w.run_once()
    r = t.answers[-1].result
    assert (r.status, r.reason) == (Status.REJECTED, Reason.POSITION_GAP)


def test_a_continuation_pushed_ahead_continues_from_the_sessions_own_token() -> None:
    """The opening samples; a job with no token behind it (pushed before the producer read the token) feeds
    that token: the same tokens as the session alone. A second one pushed ahead at the wrong position is
    refused (below: duplicate, above: gap) and changes nothing."""
    w, t = _worker()
    t.push(_open(w, "ah"))
    w.run_once()  # the worker reads decode entries before prefill ones: open first
    t.push(_decode(w, "ah", 3, (), 5))
    t.push(_decode(w, "ah", 9, (), 5))  # a gap: the first one ends at 8
    t.push(_decode(w, "ah", 8, (), 5))
    t.push(_decode(w, "ah", 8, (), 2, "x"))  # the same start again under another id: duplicate
    for _ in range(20):
        w.run_once()
    by_id = {a.result.job_id: a.result for a in t.answers}
    assert by_id["ah-d9.end"].reason == Reason.POSITION_GAP
    assert by_id["ah-d8"].status == Status.OK
    toks = [a.result.token for a in t.answers if a.result.token is not None]
    assert toks == oracle(Sess(prompt=(3, 4, 5), max_tokens=11, n=5))
    assert [a.result.job_id for a in t.answers if a.result.reason == Reason.DUPLICATE] == ["ah-d8x"]


def test_decode_calls_are_full_under_credit() -> None:
    """Four sessions under credit and a slow producer (it acts on results only every third fused call, as
    a Tracker whose round trip is longer than a step): after their prompts, every iteration of the worker
    is a decode call with all four sessions; none waits on the producer between jobs. (With n = 1 two
    iterations in three would have no call.)"""
    t = MemoryTransport()
    w = Worker(HistoryEngine(4), t, WorkerSettings(worker_id=WID, max_batch=8, block_ms=0, gather_ms=0.0, await_ms=0))
    w.start()
    core = ProducerCore(verify_route=False)
    handles = []

    def send(b: Batch) -> None:
        for op in b.ops:
            if isinstance(op, XAdd):
                t.push(job_from_fields(op.fields))

    for i in range(4):
        hop = RouteHop(worker_id=WID, key=w.keys["prefill"])
        spec = SessionSpec(session_id=f"full{i}", account_id="a", route=(hop,), max_tokens=40)
        h = core.new_handle(spec, (3, 4, 5 + i), 0)
        h.credit.n = 16
        b = Batch()
        core.queue_prefill(b, h)
        send(b)
        handles.append(h)
    seen = 0
    calls: list[int] = []  # per iteration: sessions in its decode call (0: none)
    for it in range(500):
        if all(h.finished for h in handles):
            break
        n_calls = len(t.calls)
        w.run_once()
        new = [c for c in t.calls[n_calls:] if c.phase == "decode"]
        calls.append(new[0].batch_size if new else 0)
        if it % 3:
            continue
        b = Batch()
        for a in t.answers[seen:]:
            core.apply(next(h for h in handles if h.session_id == a.result.session_id), a.result)
        seen = len(t.answers)
        for h in handles:
            core.advance(b, h, True)
        send(b)
    assert all(h.status == "finished" and len(h.generated) == 40 for h in handles)
    first = next(i for i, c in enumerate(calls) if c)
    last = max(i for i, c in enumerate(calls) if c)
    assert calls[first:last + 1] == [4] * 39, calls


def test_forged_early_continuations_are_bounded_and_answered_after_the_hold() -> None:
    """Anyone who can write the decode stream can send `with_opening` jobs for sessions that never come: the
    worker holds at most 4 per slot, answers each `state_lost` after early_hold_s (nothing stays pending), and
    an honest session beside them still decodes (its continuation found room here; one that finds the holder
    full is admitted at once, `state_lost`, and its Tracker replays the session)."""
    t = MemoryTransport()
    w = Worker(HistoryEngine(2), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0,
                                                   early_hold_s=0.2))
    w.start()
    forged = [StepJob(job_id=f"ghost{i}-c", session_id=f"ghost{i}", phase="decode", compat=w.keys["decode"].digest,
                      start_position=3, tokens=(), n=4, created_at=1.0, with_opening=True) for i in range(12)]
    for job in forged:
        t.push(job)
    honest = StepJob(job_id="real-c", session_id="real", phase="decode", compat=w.keys["decode"].digest,
                     start_position=3, tokens=(), n=4, created_at=1.0, with_opening=True)
    t.push(honest)
    t.push(_open(w, "real"))  # its prompt after its continuation
    for _ in range(20):
        w.run_once()
    assert w.stats.early_held == 2 * 4  # the holder's bound: 4 per slot, 2 slots (the rest answered at once)
    real = [a.result for a in t.answers if a.result.session_id == "real" and a.result.token is not None]
    assert len(real) >= 4  # the prompt's token and the held continuation's tokens: it never waited the hold
    time.sleep(0.25)
    for _ in range(5):
        w.run_once()
    ghosts = {a.result.session_id: a.result.status for a in t.answers if a.result.session_id.startswith("ghost")}
    assert ghosts == {f"ghost{i}": Status.STATE_LOST for i in range(12)}, ghosts
    assert w.stats.early_expired >= 4
    assert not any(q for q in t.queues.values()) and all(a.final for a in t.answers if a.result.session_id in ghosts)


def _held_for_its_last_chunk(w: Worker, t: MemoryTransport, sid: str, between: Callable[[], None]
                             ) -> list[StepResult]:
    """A session's first prompt chunk (positions 0-2 of 6) queued, then its first continuation read and held for
    the prompt's last chunk; `between()`, three more iterations, and nothing answered for the continuation yet;
    then the last chunk: the session's results, whose tokens are the session's alone."""
    t.push(_open(w, sid, sample=False))
    for _ in range(3):
        w.run_once()
    t.push(StepJob(job_id=f"{sid}-c", session_id=sid, phase="decode", compat=w.keys["decode"].digest,
                   start_position=6, tokens=(), n=4, created_at=1.0, with_opening=True))
    w.run_once()
    between()
    for _ in range(3):
        w.run_once()
    assert not [a for a in t.answers if a.result.job_id.startswith(f"{sid}-c")], "answered before its prompt came"
    t.push(StepJob(job_id=f"{sid}-p3", session_id=sid, phase="prefill", compat=w.keys["prefill"].digest,
                   start_position=3, tokens=(6, 7, 8), sample=True, created_at=1.0))
    for _ in range(20):
        w.run_once()
    results = [a.result for a in t.answers if a.result.session_id == sid]
    toks = [r.token for r in results if r.token is not None]
    assert toks == oracle(Sess(prompt=(3, 4, 5, 6, 7, 8), max_tokens=30, n=4))[:len(toks)] and len(toks) == 5
    return results


def test_a_continuation_held_for_a_session_whose_prompt_is_still_coming_outlives_the_hold() -> None:
    """A wave of long prompts: the worker reads a session's opening chunk and its continuation, but not yet the
    prompt's last chunk (it takes no prefill entries while enough prompt tokens are queued). Past early_hold_s
    the continuation stays held while its session is open here with the prompt short of it (admitted then, it
    would be refused position_gap and end a session being served: seen on Gemma with 8 prompts of 2,016
    tokens), then follows the last chunk: the tokens of the session alone."""
    t = MemoryTransport()
    w = Worker(HistoryEngine(2), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0,
                                                   early_hold_s=0.1))
    w.start()
    results = _held_for_its_last_chunk(w, t, "long", lambda: time.sleep(0.15))
    assert all(r.status == Status.OK for r in results), results


def test_an_opening_delivered_again_does_not_release_a_continuation_its_prompt_has_not_reached() -> None:
    """A Tracker that re-pushes what it has not read after an outage (or `open()` twice) sends a session's opening
    again while the worker holds the session's first continuation for the prompt's last chunk. The opening is
    answered at once (a duplicate, acked) but opens nothing: the continuation stays held until that chunk is queued
    (released with the duplicate, it was refused position_gap and ended a session being served), then decodes the
    tokens of the session alone."""
    t = MemoryTransport()
    w = Worker(HistoryEngine(2), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0))
    w.start()
    results = _held_for_its_last_chunk(w, t, "again", lambda: t.push(_open(w, "again", sample=False)))
    assert all(r.status == Status.OK for r in results if r.job_id != "again-open"), results

def test_a_continuation_whose_opening_is_unread_behind_queued_prompts_outlives_the_hold() -> None:
    """The reader takes no prefill entries while two calls' worth of prompt tokens are queued: a session's
    continuation (on the decode stream) is read and held while its opening waits in the prefill stream behind
    another session's long prompt, longer than early_hold_s. Held on while the reader takes no prompt entries
    (admitted at the hold it was answered state_lost, and its Tracker replayed a session never lost), it
    follows its opening once that is read: the tokens of the session alone."""
    t = MemoryTransport()
    w = Worker(HistoryEngine(2), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0,
                                                   early_hold_s=0.05, prefill_budget=4))
    w.start()
    hop = RouteHop(worker_id=WID, key=w.keys["prefill"])
    t.push(_open(w, "dec"))  # a session decoding throughout: prefill calls take at most prefill_budget tokens
    w.run_once()
    t.push(_decode(w, "dec", 3, (), 29))
    w.run_once()
    t.push(StepJob(job_id="big-open", session_id="big", phase="prefill", compat=w.keys["prefill"].digest,
                   start_position=0, tokens=tuple(range(3, 43)), sample=True, created_at=1.0,
                   session=SessionSpec(session_id="big", account_id="a", route=(hop,), max_tokens=2)))
    for _ in range(2):
        w.run_once()  # 40 prompt tokens queued: the reader takes no prefill entries until fewer than 8 are
    t.push(StepJob(job_id="late-c", session_id="late", phase="decode", compat=w.keys["decode"].digest,
                   start_position=3, tokens=(), n=4, created_at=1.0, with_opening=True))
    t.push(_open(w, "late"))
    w.run_once()
    for _ in range(3):
        time.sleep(0.06)
        w.run_once()
    assert not [a for a in t.answers if a.result.session_id == "late"], "answered before its opening was read"
    for _ in range(40):
        w.run_once()
    late = [a.result for a in t.answers if a.result.session_id == "late"]
    assert all(r.status == Status.OK for r in late), late
    toks = [r.token for r in late if r.token is not None]
    assert toks == oracle(Sess(prompt=(3, 4, 5), max_tokens=30, n=4))[:len(toks)] and len(toks) == 5
