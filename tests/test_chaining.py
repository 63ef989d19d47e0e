"""Decode calls chained on the engine thread (consumer/sched/chaining.py, consumer/worker/chain.py) against the
scheduler as it runs without them, the oracle: random sessions of continuation jobs (greedy or sampled, stop
tokens, max_tokens, the Tracker's next job pushed when one ends, cancellations read before the engine thread
takes the offered call and after it went on with it), the engine a function of each row's session, position and
input token (so a wrong input shows in every later token). Every session's answers equal its answers without
chaining (the same result ids, tokens, positions, ends, charges), every job is answered once, nothing is lost,
and the scheduler ends empty; a cancelled session's tokens are a prefix of its own."""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batch import EngineOutput
from consumer.sampler import BatchSampler
from consumer.sampling.stage import plain
from consumer.sched import Answer, ScheduledBatch, Scheduler
from schemas import Sampling, Status, StepJob
from tests.test_decode_rows import Plan, continuation
from tests.test_scheduler import DIGESTS, admit, make, opening

VOCAB = 16
SOAK = os.environ.get("DGR_SOAK") == "1"


def chat(prompt: int, max_tokens: int, stop: tuple[int, ...], n: int, sampled: bool) -> Plan:
    """A session of tests/test_decode_rows.py's kind, its cancellations given apart (drive's `cancels`)."""
    return Plan(prompt, max_tokens, stop, n, None, False, sampled)


plans = st.builds(chat, prompt=st.integers(1, 5), max_tokens=st.integers(1, 14),
                  stop=st.sampled_from([(), (), (3,), (0, 5, 9)]), n=st.integers(1, 6),
                  sampled=st.sampled_from([False, False, False, True]))


def holders(batch: ScheduledBatch, holder: Callable[[int], str | None]) -> list[str]:
    """The session of each row that wants logits, as the engine starts the call (`holder` of its slot)."""
    return [holder(int(slot)) or "closed" for slot in batch.fused.slots[batch.fused.wants_logits].tolist()]


def engine(batch: ScheduledBatch, sessions: list[str]) -> np.ndarray:
    """One logits row per row that wants logits, peaked at a hash of its session, position and input token."""
    want = np.flatnonzero(batch.fused.wants_logits)
    out = np.zeros((want.shape[0], VOCAB), dtype=np.float32)
    for i, (row, sid) in enumerate(zip(want.tolist(), sessions, strict=True)):
        fed, pos = int(batch.fused.tokens[row]), int(batch.fused.positions[row])
        out[i, (sum(map(ord, sid)) + 3 * pos + 7 * fed) % VOCAB] = 10.0
    return out


def started(batch: ScheduledBatch | None, s: Scheduler, computed: dict[str, int]) -> list[str]:
    """A call the engine starts: its rows' sessions, its decode rows counted per session."""
    if batch is None:
        return []
    sessions = holders(batch, s.table.session_at)
    if batch.phase == "decode":
        for sid in sessions:
            computed[sid] += 1
    return sessions


def drive(ps: list[Plan], slots: int, max_batch: int, cancels: dict[int, list[tuple[int, bool]]],
          chain: bool) -> tuple[dict[str, list[Answer]], int, Scheduler]:
    """Every answer by session, the chained calls, and the scheduler at the end. cancels: iteration -> (session,
    read after the engine thread took the offered call). Asserts that the engine computes no decode row that is
    not answered (a session ended by the call before has no row after it), but for cancelled sessions."""
    s: Scheduler = make(n_slots=slots, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=max_batch,
                        prefill_budget=16)
    sampler = BatchSampler(VOCAB)
    jobs: dict[str, itertools.count[int]] = defaultdict(itertools.count)  # per session: ids alike in both runs
    by_session: dict[str, list[Answer]] = defaultdict(list)
    for i, p in enumerate(ps):
        sid = f"s{i}"
        sampling = Sampling(temperature=1.0, seed=i) if p.sampled else Sampling()
        first = opening(sid, p.prompt, job_id=f"{sid}-open", max_tokens=p.max_tokens, stop=p.stop, sampling=sampling)
        if admit(s, first) is None:
            admit(s, continuation(sid, p.prompt, p.n, next(jobs[sid])))

    def took(answers: list[Answer]) -> None:
        for a in answers:
            by_session[a.result.session_id].append(a)
            r = a.result
            if a.job is not None and a.job.phase == "decode" and r.status == Status.OK and a.final and not r.finished:
                admit(s, continuation(a.job.session_id, r.position, a.job.n, next(jobs[a.job.session_id])))

    current: ScheduledBatch | None = None  # handed out, computing
    rows: list[int] | None = None  # of the engine's rows, those of `current` (a chained call's kept ones)
    ran: ScheduledBatch | None = None  # what the engine computes (a chained call as offered)
    offered = None
    chained = 0
    computed: dict[str, int] = defaultdict(int)  # decode rows the engine ran, per session
    sessions: list[str] = []  # of the rows of the call computing
    next_sessions: list[str] = []
    for t in range(400):
        events = cancels.get(t, [])
        early = [f"s{i}" for i, late in events if not late and i < len(ps)]
        if early or s.has_work():
            offered = None  # the loop withdraws it (worker/loop.py)
        answers: list[Answer] = []
        for sid in early:
            answers += s.cancel(sid)
        took(answers)
        went_on = None
        if ran is not None:
            logits = engine(ran, sessions)
            if offered is not None:  # the engine thread, at the end of the call
                tokens = sampler.greedy_tokens(logits, list)
                if tokens is not None and offered.fill(tokens):
                    went_on = offered
                    next_sessions = started(went_on.batch, s, computed)
            offered = None
            late = [f"s{i}" for i, late in events if late and i < len(ps)]
            took([a for sid in late for a in s.cancel(sid)])
            if current is not None:  # the loop samples and reports it
                out = EngineOutput.logits(logits if rows is None else logits[rows])
                took(s.update_from_output(current, sampler(current, out), 0.001))
        if went_on is not None:
            adopted = s.adopt(went_on)
            assert adopted.answers == [], "a session lost"
            current, rows, ran, sessions = adopted.batch, adopted.rows, went_on.batch, next_sessions
            chained += 1
        else:
            for slot in s.drain_released():
                s.slot_cleared(slot)
            current, rows = s.next_batch(), None
            ran, sessions = current, started(current, s, computed)
        if ran is None:
            break
        if chain and current is not None:
            offered = s.successor(current, plain)
            # a chained call adopted without some of its rows (sessions closed: their slots wait to be cleared) is
            # followed by none, so a row's source is always the engine's row (InFlightCall.chain_next relies on it)
            assert offered is None or rows is None or len(rows) == len(ran.fused)
    else:
        raise AssertionError("still working after 400 calls")
    for slot in s.drain_released():
        s.slot_cleared(slot)
    cancelled = {f"s{i}" for evs in cancels.values() for i, _ in evs}
    for sid, n in computed.items():
        decoded = [a for a in by_session[sid] if a.job is not None and a.job.phase == "decode"
                   and a.result.status == Status.OK]
        assert sid in cancelled or n == len(decoded), (sid, n, len(decoded))
    return by_session, chained, s


def _seen(a: Answer) -> tuple[Any, ...]:
    r = a.result
    return (r.job_id, r.status, r.reason, r.token, r.position, r.finished, r.prompt_tokens, a.close, a.final)


@settings(max_examples=1500 if SOAK else 120, deadline=None)
@given(st.lists(plans, min_size=1, max_size=7), st.integers(1, 6), st.integers(1, 6),
       st.dictionaries(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=2),
                       max_size=3))
def test_chained_calls_answer_as_the_scheduler_alone(ps: list[Plan], slots: int, max_batch: int,
                                                      cancels: dict[int, list[tuple[int, bool]]]) -> None:
    alone, _, _ = drive(ps, slots, max_batch, {}, chain=False)
    got, _, s = drive(ps, slots, max_batch, cancels, chain=True)
    cancelled = {f"s{i}" for evs in cancels.values() for i, _ in evs}
    for sid, answers in got.items():
        finals = [a.result.job_id for a in answers if a.final]
        assert len(finals) == len(set(finals)), (sid, finals)
        if sid not in cancelled:
            assert [_seen(a) for a in answers] == [_seen(a) for a in alone[sid]], sid
        else:
            mine = [(a.result.position, a.result.token) for a in answers if a.result.token is not None]
            own = [(a.result.position, a.result.token) for a in alone[sid] if a.result.token is not None]
            assert mine == own[:len(mine)], sid
    assert not s._lanes and not s._inflight and s.table.busy_slots == 0


def test_calls_are_chained_and_a_stop_ends_the_chain() -> None:
    """Not vacuous: four greedy sessions decode in chained calls; one whose stop token is its third decoded token
    finishes there, with the answers it has without chaining (the call after a stop is never run ahead:
    Successor.fill refuses it, and nothing is written)."""
    ps = [chat(prompt=2, max_tokens=12, stop=(), n=4, sampled=False) for _ in range(4)]
    alone, chained, _ = drive(ps, 4, 4, {}, chain=True)
    assert chained >= 8
    third = [a.result.token for a in alone["s0"] if a.result.token is not None][3]
    ps[0] = chat(prompt=2, max_tokens=12, stop=(third,), n=4, sampled=False)
    want, _, _ = drive(ps, 4, 4, {}, chain=False)
    got, chained, _ = drive(ps, 4, 4, {}, chain=True)
    assert chained >= 4 and [_seen(a) for a in got["s0"]] == [_seen(a) for a in want["s0"]]
    assert [a.result.token for a in got["s0"] if a.result.finished] == [third]


def test_fill_refuses_a_token_that_ends_its_session() -> None:
    s: Scheduler = make(n_slots=2, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=2, prefill_budget=16)
    for sid, stop in (("a", (5,)), ("b", ())):
        assert admit(s, opening(sid, 2, max_tokens=9, stop=stop)) is None
        assert admit(s, continuation(sid, 2, 4, 0)) is None
    b = s.next_batch()
    assert b is not None and b.phase == "prefill"
    s.update_from_output(b, [1, 1], 0.001)
    b = s.next_batch()
    assert b is not None and b.phase == "decode"
    nxt = s.successor(b, plain)
    assert nxt is not None and list(nxt.source) == [0, 1] and not nxt.own.any()
    before = nxt.batch.fused.tokens.copy()
    assert not nxt.fill(np.array([5, 5]))  # a's stop
    assert (nxt.batch.fused.tokens == before).all()
    assert nxt.fill(np.array([6, 5]))  # b has no stop token
    assert list(nxt.batch.fused.tokens) == [6, 5]


def test_a_next_job_carrying_its_token_follows_only_a_token_that_does_not_end_the_session() -> None:
    """A session whose job ends in the call and whose next job (queued) carries its own input token: its row's
    input is that token, and a stop token sampled for it in the call before still ends the session there (no row
    follows it)."""
    s: Scheduler = make(n_slots=1, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=1, prefill_budget=16)
    assert admit(s, opening("a", 2, max_tokens=9, stop=(5,))) is None
    assert admit(s, continuation("a", 2, 1, 0)) is None
    b = s.next_batch()
    assert b is not None
    s.update_from_output(b, [1], 0.001)
    b = s.next_batch()
    assert b is not None and b.phase == "decode"
    carried = StepJob(job_id="a-t", session_id="a", phase="decode", compat=DIGESTS["decode"], start_position=3,
                      tokens=(11,), created_at=0.0)
    assert admit(s, carried) is None
    nxt = s.successor(b, plain)
    assert nxt is not None and list(nxt.own) == [True] and list(nxt.batch.fused.tokens) == [11]
    assert not nxt.fill(np.array([5]))  # the call before ends the session: no row after it
    assert nxt.fill(np.array([6])) and list(nxt.batch.fused.tokens) == [11]


def test_a_row_the_scheduler_would_not_hand_out_loses_its_session() -> None:
    """adopt's check: a chained row whose input is not the token the loop's report gave the session (the engine
    thread and the sampler disagreeing) is not handed out; its session is answered state_lost (its engine state
    holds a row no one asked for) and the other rows are adopted."""
    s: Scheduler = make(n_slots=2, ctx=64, max_tokens_per_call=32, vocab=VOCAB, max_batch=2, prefill_budget=16)
    for sid in ("a", "b"):
        assert admit(s, opening(sid, 2, max_tokens=9)) is None
        assert admit(s, continuation(sid, 2, 4, 0)) is None
    b = s.next_batch()
    assert b is not None
    s.update_from_output(b, [1, 1], 0.001)
    b = s.next_batch()
    assert b is not None and b.phase == "decode"
    nxt = s.successor(b, plain)
    assert nxt is not None and nxt.fill(np.array([6, 7]))
    nxt.batch.fused.tokens[1] = 8  # b's input, not what b sampled
    s.update_from_output(b, [6, 7], 0.001)
    adopted = s.adopt(nxt)
    assert adopted.batch is not None and [it.session_id for it in adopted.batch.items] == ["a"]
    assert adopted.rows == [0]
    assert [(a.result.session_id, a.result.status) for a in adopted.answers] == [("b", Status.STATE_LOST)]
    assert s.table.get("b") is None


def test_a_session_cancelled_while_its_chained_row_computes(monkeypatch: Any) -> None:
    """A cancel read after the engine thread went on with the chained call: that call is adopted without the
    cancelled session's row (its output dropped), no call is chained after it (the session's slot waits to be
    cleared: `drive` asserts it), the session answers cancelled with a prefix of its tokens and the others go on
    as without chaining."""
    partial: list[int] = []
    adopt = Scheduler.adopt

    def counting(self: Scheduler, successor: Any) -> Any:
        got = adopt(self, successor)
        if len(got.rows) < len(successor.rows):
            partial.append(len(successor.rows) - len(got.rows))
        return got

    monkeypatch.setattr(Scheduler, "adopt", counting)
    ps = [chat(prompt=2, max_tokens=12, stop=(), n=6, sampled=False) for _ in range(3)]
    alone, _, _ = drive(ps, 3, 3, {}, chain=False)
    got, chained, _ = drive(ps, 3, 3, {4: [(0, True)]}, chain=True)
    assert partial == [1] and chained >= 4
    assert got["s0"][-1].result.status == Status.CANCELLED
    mine = [a.result.token for a in got["s0"] if a.result.token is not None]
    assert mine == [a.result.token for a in alone["s0"] if a.result.token is not None][:len(mine)]
    for sid in ("s1", "s2"):
        assert [_seen(a) for a in got[sid]] == [_seen(a) for a in alone[sid]]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fill_refuses_exactly_the_rows_whose_token_is_one_of_their_own_stops(data: st.DataObject) -> None:
    """Successor.fill against its definition, whatever the number of stop tokens in the call (a few, compared at
    once, or more than a session may have: np.isin): False, and nothing written, when some row's token is one of
    its own session's stop tokens; else every input written."""
    from consumer.batch import FusedBatch
    from consumer.sched.chaining import Successor

    n = data.draw(st.integers(1, 12))
    vocab = data.draw(st.sampled_from([8, 64]))  # small: stops and tokens meet often
    stops = [tuple(data.draw(st.lists(st.integers(0, vocab - 1), max_size=16, unique=True))) for _ in range(n)]
    sampled = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)), dtype=np.int64)
    fused = FusedBatch(phase="decode", slots=np.arange(n, dtype=np.int32), positions=np.zeros(n, np.int32),
                       tokens=np.full(n, -1, np.int32), wants_logits=np.ones(n, np.bool_))
    any_stop = np.array(sorted({t for s in stops for t in s}), dtype=np.int64)
    succ = Successor((), ScheduledBatch("decode", fused, ()), np.arange(n, dtype=np.intp), np.zeros(n, np.bool_),
                     tuple(stops), any_stop)
    ends = any(int(sampled[r]) in stops[r] for r in range(n))
    assert succ.fill(sampled) is (not ends)
    assert list(fused.tokens) == ([-1] * n if ends else sampled.tolist())
