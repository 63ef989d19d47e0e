"""Property tests: the scheduler driven by a simulated producer and engine over random arrivals.

Checked on every call: WRR bounds (decode waits at most ceil(w_prefill / w_decode) consecutive
prefill calls, prefill at most ceil(w_decode / w_prefill) consecutive decode calls, hence is served
at least once every w_decode + w_prefill calls), call sizes, per-session position continuity, no two
items of a call on one slot with overlapping positions. At the end: every admitted job answered
exactly once, every session closed, every slot free again, no session left waiting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from consumer.sched import Answer, ScheduledBatch
from consumer.sched.prefill_shape import MIN_BUDGET
from schemas import Reason, Sampling, Status
from tests.test_scheduler import admit, decode, make, opening, prefill, report

VOCAB = 16
MAX_CALLS = 4000


def toks(start: int, n: int) -> tuple[int, ...]:
    return tuple((start + i) % VOCAB for i in range(n))


def target(sid: str, pos: int) -> int:
    return (pos * 7 + sum(map(ord, sid))) % VOCAB


@dataclass
class SessionPlan:
    sid: str
    arrival: int  # call index at which the producer sends the prefill
    chunks: list[int]  # prefill job sizes
    max_tokens: int
    stop: tuple[int, ...]
    cancel_at: int | None
    sampled: bool
    cancel_in_flight: bool = False  # cancel between next_batch and the call's report


@dataclass
class Scenario:
    n_slots: int
    max_batch: int
    budget: int
    max_tokens_per_call: int
    w_decode: int
    w_prefill: int
    sessions: list[SessionPlan]
    failures: dict[int, bool]  # call index -> fail the whole call (True) or only its first session


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    n = draw(st.integers(1, 10))
    sessions = [
        SessionPlan(
            sid=f"s{i}",
            arrival=draw(st.integers(0, 30)),
            chunks=draw(st.lists(st.integers(1, 20), min_size=1, max_size=3)),
            max_tokens=draw(st.integers(1, 6)),
            stop=draw(st.sampled_from([(), (3,), (0, 5, 9)])),
            cancel_at=draw(st.none() | st.integers(0, 60)),
            sampled=draw(st.booleans()),
            cancel_in_flight=draw(st.booleans()),
        )
        for i in range(n)
    ]
    return Scenario(
        n_slots=draw(st.integers(1, 6)),
        max_batch=draw(st.integers(1, 6)),
        budget=draw(st.integers(1, 24)),
        max_tokens_per_call=draw(st.integers(1, 32)),
        w_decode=draw(st.integers(1, 5)),
        w_prefill=draw(st.integers(1, 5)),
        sessions=sessions,
        failures=draw(st.dictionaries(st.integers(0, 80), st.booleans(), max_size=3)),
    )


@dataclass
class Model:
    """What the producer and an engine-side observer know."""

    answered: dict[str, int] = field(default_factory=dict)  # job_id -> answers
    queued: set[str] = field(default_factory=set)  # job ids admitted (None from admit)
    position: dict[str, int] = field(default_factory=dict)  # session -> engine position
    generated: dict[str, int] = field(default_factory=dict)
    closed: dict[str, str] = field(default_factory=dict)  # session -> how
    to_send: list[tuple[str, int, int]] = field(default_factory=list)  # decode steps to send next call

    def answer(self, a: Answer) -> None:
        assert a.job is not None
        self.answered[a.job.job_id] = self.answered.get(a.job.job_id, 0) + 1
        if a.close is not None:
            assert a.job.session_id not in self.closed
            self.closed[a.job.session_id] = a.close


class Sim:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.s = make(n_slots=sc.n_slots, ctx=256, max_tokens_per_call=sc.max_tokens_per_call, vocab=VOCAB,
                      max_batch=sc.max_batch, prefill_budget=sc.budget, w_decode=sc.w_decode,
                      w_prefill=sc.w_prefill)
        self.m = Model()
        self.plans = {p.sid: p for p in sc.sessions}
        self.waiting = sorted(sc.sessions, key=lambda p: p.arrival)  # not yet opened
        self.opened: set[str] = set()
        self.decode_streak = 0  # consecutive prefill calls while decode was ready
        self.prefill_streak = 0  # consecutive decode calls while prefill was ready
        self.max_decode_streak = 0
        self.max_prefill_streak = 0
        self.capacity_retries = 0
        self.both_ready = 0

    def send(self, job_reply: Answer | None, job_id: str) -> None:
        if job_reply is None:
            self.m.queued.add(job_id)
        else:
            self.m.answer(job_reply)

    def open_arrivals(self, t: int) -> None:
        still = []
        for p in self.waiting:
            if p.arrival > t:
                still.append(p)
                continue
            sampling = Sampling(temperature=1.0, seed=len(p.sid)) if p.sampled else Sampling()
            first = opening(p.sid, toks(0, p.chunks[0]), max_tokens=p.max_tokens, stop=p.stop, sampling=sampling,
                            sample=len(p.chunks) == 1)
            r = admit(self.s, first)
            if r is not None:
                assert r.result.reason == Reason.CAPACITY
                still.append(p)  # the producer retries later
                self.capacity_retries += 1
                continue
            self.m.queued.add(first.job_id)
            self.opened.add(p.sid)
            self.m.position[p.sid] = 0
            self.m.generated[p.sid] = 0
            start = p.chunks[0]
            for i, n in enumerate(p.chunks[1:], start=2):
                job = prefill(p.sid, start, toks(start, n), sample=i == len(p.chunks))
                assert admit(self.s, job) is None
                self.m.queued.add(job.job_id)
                start += n
        self.waiting = still

    def step(self, t: int) -> bool:
        s, m = self.s, self.m
        self.cancel(t, in_flight=False)
        self.open_arrivals(t)
        sends, m.to_send = m.to_send, []
        for sid, pos, tok in sends:
            job = decode(sid, pos, tok)
            self.send(admit(s, job), job.job_id)
        for slot in s.drain_released():
            s.slot_cleared(slot)
        ready_d, ready_p = s.ready("decode") > 0, s.ready("prefill") > 0
        assert s.has_work() == (ready_d or ready_p)
        b = s.next_batch()
        if b is None:
            assert not s.has_work()
            return bool(self.waiting) or bool(m.to_send) or s.queued() > 0
        self.check_batch(b)
        self.check_wrr(b, ready_d, ready_p)
        self.cancel(t, in_flight=True)
        released = s.drain_released()
        assert not set(released) & set(b.fused.slots.tolist()), "a slot released while its call runs"
        for slot in released:
            s.slot_cleared(slot)
        self.both_ready += ready_d and ready_p
        if t in self.sc.failures:
            if self.sc.failures[t]:
                outs = s.fail(b, "injected")
            else:
                bad = b.session_ids[:1]
                rest = b.without(bad)
                failed_part = b.without(b.session_ids[1:])
                assert failed_part is not None
                outs = s.fail(failed_part, "injected")
                if rest is not None:
                    outs += self.complete(rest)
        else:
            outs = self.complete(b)
        for o in outs:
            self.observe(o)
        self.check_counts()
        return True

    def check_counts(self) -> None:
        """Each phase queue's counters (consumer/sched/phase_queue.py) are what the sessions' queues hold."""
        for phase, queue in self.s._queues.items():
            held = [q for lane in self.s._lanes.values() for q in lane.jobs if q.job.phase == phase]
            left = sum(1 if phase == "decode" else len(q.job.tokens) - q.consumed for q in held)
            assert (queue.jobs, queue.tokens) == (len(held), left), phase
            assert queue.n_ready == sum(1 for lane in self.s._lanes.values() if lane.ready_phase == phase)

    def cancel(self, t: int, in_flight: bool) -> None:
        for p in self.sc.sessions:
            if p.cancel_at == t and p.cancel_in_flight == in_flight and p.sid in self.opened \
                    and p.sid not in self.m.closed:
                replies = self.s.cancel(p.sid)
                for r in replies:
                    assert r.result.status == Status.CANCELLED
                    self.m.answer(r)
                if not replies:
                    self.m.closed[p.sid] = "cancelled"

    def complete(self, b: ScheduledBatch) -> list[Answer]:
        rows = [it for it in b.items if it.samples]
        logits = np.zeros((len(rows), VOCAB), dtype=np.float32)
        for i, it in enumerate(rows):
            logits[i, target(it.job.session_id, it.first_position + it.n_tokens)] = 5.0
        outs = report(self.s, b, logits, 0.001 * len(b.fused))
        for it in b.items:  # the engine-side view: the slot now holds these positions
            if it.job.session_id in self.m.position:
                self.m.position[it.job.session_id] = it.first_position + it.n_tokens
        return outs

    def check_batch(self, b: ScheduledBatch) -> None:
        cfg = self.s.config
        f = b.fused
        assert 0 < len(f) <= self.sc.max_tokens_per_call
        assert len(f) == sum(it.n_tokens for it in b.items)
        if b.phase == "decode":
            assert len(b.items) <= min(self.sc.max_batch, self.sc.n_slots) and len(f) == len(b.items)
            assert f.wants_logits.all()
        else:
            assert len(f) <= min(max(self.sc.budget, MIN_BUDGET), cfg.capacity.max_tokens_per_call)
        assert f.n_logit_rows == sum(it.samples for it in b.items)
        # Rows match items; per slot one session, positions contiguous and continuing the session.
        nxt: dict[int, int] = {}
        owner: dict[int, str] = {}
        for it in b.items:
            sid = it.job.session_id
            assert owner.setdefault(it.slot, sid) == sid
            expected = nxt.get(it.slot, self.m.position[sid])
            assert it.first_position == expected, (sid, it.first_position, expected)
            rows = slice(it.row_start, it.row_start + it.n_tokens)
            assert f.slots[rows].tolist() == [it.slot] * it.n_tokens
            assert f.positions[rows].tolist() == list(range(expected, expected + it.n_tokens))
            assert f.tokens[rows].tolist() == list(it.job.tokens[it.offset:it.offset + it.n_tokens])
            assert f.wants_logits[rows].tolist() == [False] * (it.n_tokens - 1) + [it.samples]
            assert it.samples == (it.job.sample and it.completes_job)
            nxt[it.slot] = expected + it.n_tokens
        for slot in set(f.slots.tolist()):
            pos = f.positions[f.slots == slot]
            assert len(set(pos.tolist())) == len(pos)  # no overlapping positions on one slot

    def check_wrr(self, b: ScheduledBatch, ready_d: bool, ready_p: bool) -> None:
        sc = self.sc
        if ready_d and b.phase == "prefill":
            self.decode_streak += 1
        else:
            self.decode_streak = 0
        if ready_p and b.phase == "decode":
            self.prefill_streak += 1
        else:
            self.prefill_streak = 0
        assert self.decode_streak <= math.ceil(sc.w_prefill / sc.w_decode)
        assert self.prefill_streak <= math.ceil(sc.w_decode / sc.w_prefill)
        assert self.prefill_streak < sc.w_decode + sc.w_prefill
        self.max_decode_streak = max(self.max_decode_streak, self.decode_streak)
        self.max_prefill_streak = max(self.max_prefill_streak, self.prefill_streak)

    def observe(self, o: Answer) -> None:
        m = self.m
        m.answer(o)
        sid, r = o.job.session_id, o.result
        assert o.account_id == "acct"
        if r.status == Status.OK:
            assert r.position == o.job.end_position
            assert r.batch_size >= 1
            if r.token is not None:
                m.generated[sid] += 1
                plan = self.plans[sid]
                done = m.generated[sid] >= plan.max_tokens or r.token in plan.stop
                assert r.finished == done and (o.close == "finished") == done
                if not plan.sampled:
                    assert r.token == target(sid, r.position)
                if not done:
                    m.to_send.append((sid, r.position, r.token))
            else:
                assert not o.job.sample and not r.finished
        elif r.status == Status.FAILED:
            assert r.reason == Reason.ENGINE_ERROR
            m.position.pop(sid, None)
            m.closed.setdefault(sid, "failed")  # failures close with no close flag (drain_closed has it)
        else:
            assert r.status in (Status.CANCELLED, Status.REJECTED)
            assert r.reason in (Reason.CANCELLED, Reason.FINISHED)


def simulate(sc: Scenario) -> Sim:
    sim = Sim(sc)
    t = 0
    while sim.step(t):
        t += 1
        assert t < MAX_CALLS, "a session waits forever"
    s, m = sim.s, sim.m
    # Every admitted job was answered exactly once; every answer is for a job we sent.
    assert all(n == 1 for n in m.answered.values()), {k: n for k, n in m.answered.items() if n != 1}
    assert m.queued <= set(m.answered)
    assert s.queued() == 0 and s.in_flight() == 0 and not s.has_work()
    # Every session is closed, and every slot comes back.
    assert set(m.closed) == {p.sid for p in sc.sessions}
    assert len(s.table) == 0 and s.awaiting_decode() == 0
    for slot in s.drain_released():
        s.slot_cleared(slot)
    assert s.table.n_free == sc.n_slots
    st_ = s.stats
    event(f"closed: {sorted(set(m.closed.values()))}")
    event(f"split prefill: {any(len(p.chunks) > 1 or sum(p.chunks) > s.config.prefill_budget for p in sc.sessions)}")
    event(f"capacity retries: {sim.capacity_retries > 0}")
    event(f"both phases ready at some call: {sim.both_ready > 0}")
    event(f"stale items: {st_.stale_items}")
    closures = s.drain_closed()
    assert sorted(c.session_id for c in closures) == sorted(m.closed)
    assert {c.session_id: c.kind for c in closures} == m.closed
    return sim


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_random_arrivals(sc: Scenario) -> None:
    simulate(sc)


@settings(max_examples=40, deadline=None)
@given(w_decode=st.integers(1, 8), w_prefill=st.integers(1, 8), budget=st.integers(1, 16),
       max_batch=st.integers(1, 4))
def test_wrr_bounds_are_reached_when_saturated(w_decode: int, w_prefill: int, budget: int,
                                               max_batch: int) -> None:
    """Both phases backlogged for the whole run: the bounds hold and are tight (not vacuous)."""
    sessions = [SessionPlan(sid=f"d{i}", arrival=0, chunks=[1], max_tokens=10_000, stop=(), cancel_at=None,
                            sampled=False) for i in range(max_batch)]
    sessions += [SessionPlan(sid=f"p{i}", arrival=0, chunks=[budget] * 3, max_tokens=1, stop=(),
                             cancel_at=None, sampled=False) for i in range(40)]
    sc = Scenario(n_slots=64, max_batch=max_batch, budget=budget, max_tokens_per_call=32, w_decode=w_decode,
                  w_prefill=w_prefill, sessions=sessions, failures={})
    sim = Sim(sc)
    for t in range(3 * (w_decode + w_prefill) * 8):
        sim.step(t)
    assert sim.max_decode_streak == math.ceil(w_prefill / w_decode)
    assert sim.max_prefill_streak == math.ceil(w_decode / w_prefill)
