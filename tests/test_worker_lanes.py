"""A worker of several engines (consumer/worker/lane.py) against an in-memory transport: each session is
served by the engine whose stream opened it, no fused call mixes engines, a step for one engine on
another's stream is answered `incompatible`, cancels and engine failures stay in their lane, the lanes
share the calls by weight, and the heartbeat describes every engine. No Redis, no model: engines that do
no arithmetic and answer a token of their own, so every token says which engine computed it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batch import FusedBatch
from consumer.engines.base import EngineError
from consumer.engines.engine_set import EngineSet
from consumer.sched.round_robin import SmoothRoundRobin
from consumer.worker import Worker, WorkerSettings
from schemas import Reason, RouteHop, SessionSpec, Status, StepJob
from tests.doubles.null import NullEngine
from tests.memory_transport import MemoryTransport

WID = "w-lanes"
_ids = itertools.count()


class Recording(NullEngine):
    """Answers `token` to every row and records the tokens of every call; fails every call while `fail`."""

    def __init__(self, name: str, n_slots: int = 4, log: list[str] | None = None) -> None:
        model, token, _ = ENGINES[name]
        super().__init__(n_slots=n_slots, vocab_size=64, token=token, model=model)
        self.name, self.log = name, log if log is not None else []
        self.fed: list[list[int]] = []
        self.fail = False

    def step(self, batch: FusedBatch) -> npt.NDArray[np.float32]:
        if self.fail:
            raise EngineError("the device fell over", tuple(sorted({int(s) for s in batch.slots})))
        self.fed.append([int(t) for t in batch.tokens])
        self.log.append(self.name)
        return super().step(batch)


# engine name -> (model, the token it answers, the prompt tokens of its sessions): disjoint, so a row's
# token names the engine it belongs to
ENGINES = {"a": (1, 3, (10, 11, 12)), "b": (2, 23, (30, 31, 32)), "c": (3, 43, (50, 51, 52))}


def make(names: Sequence[str] = ("a", "b", "c"), weights: dict[str, int] | None = None, n_slots: int = 4,
         transport: MemoryTransport | None = None) -> tuple[Worker, MemoryTransport, dict[str, Recording]]:
    log: list[str] = []  # the engine of every fused call, in order
    engines = {n: Recording(n, n_slots, log) for n in names}
    t = transport or MemoryTransport()
    w = Worker(EngineSet(engines, weights), t, WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0))
    w.start()
    return w, t, engines


def opening(w: Worker, engine: str, sid: str, max_tokens: int = 3, compat_of: str | None = None) -> StepJob:
    key = w.engines.keys_of(compat_of or engine)["prefill"]
    spec = SessionSpec(session_id=sid, account_id="acct", route=(RouteHop(worker_id=WID, key=key),),
                       max_tokens=max_tokens)
    return StepJob(job_id=f"j{next(_ids)}", session_id=sid, phase="prefill", compat=key.digest, start_position=0,
                   tokens=ENGINES[engine][2], created_at=1.0, session=spec)


def decode(w: Worker, engine: str, sid: str, position: int, token: int) -> StepJob:
    key = w.engines.keys_of(engine)["decode"]
    return StepJob(job_id=f"j{next(_ids)}", session_id=sid, phase="decode", compat=key.digest,
                   start_position=position, tokens=(token,), created_at=1.0)


def drive(w: Worker, t: MemoryTransport, engine_of: dict[str, str], max_iterations: int = 200) -> dict[str, list[int]]:
    """Run until every session finished, pushing each decode step (one job per token) as a Tracker would."""
    tokens: dict[str, list[int]] = {sid: [] for sid in engine_of}
    done: set[str] = set()
    seen = 0
    for _ in range(max_iterations):
        if done == set(engine_of):
            break
        w.run_once()
        for a in t.answers[seen:]:
            r = a.result
            if r.session_id not in engine_of or r.status != Status.OK:
                continue
            if r.token is not None:
                tokens[r.session_id].append(r.token)
            if r.finished:
                done.add(r.session_id)
            elif r.token is not None:
                t.push(decode(w, engine_of[r.session_id], r.session_id, r.position, r.token))
        seen = len(t.answers)
    assert done == set(engine_of), f"unfinished: {set(engine_of) - done}"
    return tokens


def test_each_session_is_served_by_its_engine_and_no_call_mixes_engines() -> None:
    w, t, engines = make()
    engine_of = {f"{e}{i}": e for e in engines for i in range(3)}
    for sid, e in engine_of.items():
        t.push(opening(w, e, sid))
    tokens = drive(w, t, engine_of)
    for sid, e in engine_of.items():
        assert tokens[sid] == [ENGINES[e][1]] * 3, sid  # every token is its engine's
    for name, eng in engines.items():
        own = {*ENGINES[name][2], ENGINES[name][1]}
        assert eng.fed and all(set(call) <= own for call in eng.fed), name  # no row of another engine
    assert w.lanes.busy_slots() == 0 and w.stats.fused_calls == sum(len(e.fed) for e in engines.values())
    assert [lane.fused_calls for lane in w.lanes] == [len(e.fed) for e in engines.values()]


def test_a_step_for_one_engine_on_another_engines_stream_is_incompatible() -> None:
    w, t, _ = make()
    for e, other in itertools.permutations("abc", 2):  # an opening keyed for `other`, on e's stream
        t.push(opening(w, other, f"x-{e}-{other}"), digest=w.engines.keys_of(e)["prefill"].digest)
    t.push(opening(w, "a", "held"))
    w.run_once()
    stray = {a.result.session_id: (a.result.status, a.result.reason) for a in t.answers
             if a.result.session_id.startswith("x-")}
    assert stray == {f"x-{e}-{o}": (Status.REJECTED, Reason.INCOMPATIBLE) for e, o in itertools.permutations("abc", 2)}
    # a session is bound to its engine: its step on another engine's stream, keyed for that engine, too
    (ok,) = [a for a in t.answers if a.result.session_id == "held"]
    t.push(decode(w, "b", "held", ok.result.position, ok.result.token or 0))
    w.run_once()
    last = t.answers[-1].result
    assert (last.session_id, last.status, last.reason) == ("held", Status.REJECTED, Reason.INCOMPATIBLE)
    assert w.lanes[0].holds("held") and not w.lanes[1].holds("held")
    t.push(decode(w, "a", "held", ok.result.position, ok.result.token or 0))  # on its own stream it goes on
    w.run_once()
    assert (t.answers[-1].result.status, t.answers[-1].result.token) == (Status.OK, ENGINES["a"][1])


def test_a_cancel_finds_the_engine_holding_the_session() -> None:
    w, t, _ = make()
    t.push(opening(w, "a", "sa"))
    t.push(opening(w, "c", "sc"))
    w.run_once()
    w.run_once()
    assert w.lanes[2].holds("sc") and w.lanes.busy_slots() == 2
    t.cancel("sc")
    w.run_once()
    assert not w.lanes[2].holds("sc") and w.lanes[0].holds("sa")
    assert ("sc", "cancelled") in t.closed and w.lanes[2].scheduler.table.busy_slots == 0


def test_an_engine_failure_concerns_its_own_sessions_only() -> None:
    w, t, engines = make()
    engines["b"].fail = True
    engine_of = {f"{e}{i}": e for e in "ac" for i in range(2)}
    for sid, e in engine_of.items():
        t.push(opening(w, e, sid))
    for i in range(2):
        t.push(opening(w, "b", f"b{i}"))
    tokens = drive(w, t, engine_of)
    assert all(tokens[sid] == [ENGINES[e][1]] * 3 for sid, e in engine_of.items())
    failed = {a.result.session_id: a.result.status for a in t.answers if a.result.session_id.startswith("b")}
    assert failed == {"b0": Status.FAILED, "b1": Status.FAILED}
    assert w.lanes.busy_slots() == 0


def test_lanes_share_the_calls_by_weight() -> None:
    """Both lanes have work at every call (the same work each): weights 2:1 give a two calls in every
    three until a is done, then b alone."""
    w, t, engines = make(("a", "b"), weights={"a": 2, "b": 1}, n_slots=2)
    engine_of = {f"{e}{i}": e for e in "ab" for i in range(2)}
    for sid, e in engine_of.items():
        t.push(opening(w, e, sid, max_tokens=12))
    drive(w, t, engine_of)
    log = engines["a"].log
    assert len(log) == 24 and log.count("a") == log.count("b") == 12  # one call per token, each lane
    for k in range(6):
        assert sorted(log[3 * k:3 * k + 3]) == ["a", "a", "b"], log
    assert log[18:] == ["b"] * 6


def test_the_heartbeat_describes_every_engine() -> None:
    w, t, _ = make()
    t.push(opening(w, "b", "sb"))
    w.run_once()
    info = w._info()
    assert info["slots"] == 12 and info["busy_slots"] == 1
    engines = info["engines"]
    assert isinstance(engines, list) and [e["engine"] for e in engines] == ["a", "b", "c"]
    by = {e["engine"]: e for e in engines}
    assert by["b"]["busy_slots"] == 1 and by["a"]["busy_slots"] == 0 and by["b"]["fused_calls"] == 1
    assert by["a"]["digests"]["prefill"] == w.engines.keys_of("a")["prefill"].digest
    assert by["c"]["describe"] == {"backend": "null (no arithmetic)"} and by["c"]["state_layout"] == "kv"
    assert t.info["engines"] and len(t.streams) == 6  # registered: every engine's two streams


def test_a_one_engine_worker_is_as_it_was() -> None:
    t = MemoryTransport()
    w = Worker(NullEngine(n_slots=2, vocab_size=32), t, WorkerSettings(worker_id=WID))
    w.start()
    assert len(w.lanes) == 1 and list(w.engines) == ["main"] and w.scheduler is w.lanes[0].scheduler
    assert set(t.streams.values()) == {"mem:prefill", "mem:decode"}
    (e,) = w._info()["engines"]  # type: ignore[misc]
    assert e["engine"] == "main" and e["slots"] == 2


# ---- the lane turns, alone ------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 6), min_size=2, max_size=5), data=st.data())
def test_lane_turns_bound_the_wait_of_a_lane_with_work(weights: list[int], data: st.DataObject) -> None:
    """A lane with work waits at most 2 (W - w) calls of other lanes (W: every lane's weight together),
    whatever the others' work comes and goes; in a steady backlog each lane has exactly w of every W
    calls (from a fresh start)."""
    n, total = len(weights), sum(weights)
    turns = SmoothRoundRobin(weights)
    waited = [0] * n
    for _ in range(data.draw(st.integers(1, 120))):
        ready = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1)))
        i = turns.pick(ready)
        assert i in ready
        for j in range(n):
            waited[j] = 0 if j == i or j not in ready else waited[j] + 1
            assert waited[j] <= 2 * (total - weights[j]), (weights, j, waited)
    steady = SmoothRoundRobin(weights)
    picks = [steady.pick(list(range(n))) for _ in range(3 * total)]
    for period in range(3):
        got = picks[period * total:(period + 1) * total]
        assert [got.count(j) for j in range(n)] == weights


def test_lane_turns_leave_a_lone_lane_untouched() -> None:
    turns = SmoothRoundRobin([3, 1])
    assert [turns.pick([1]) for _ in range(4)] == [1] * 4 and turns.current == [0, 0]
    assert turns.pick([]) is None
    assert math.isclose(sum(turns.current), 0)


# ---- a search: random engine sets, sessions, cancels and a failing engine ----------------------------

@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True), data=st.data())
def test_sessions_of_any_engine_set_stay_in_their_lane(names: list[str], data: st.DataObject) -> None:
    weights = {n: data.draw(st.integers(1, 3)) for n in names}
    w, t, engines = make(names, weights=weights, n_slots=data.draw(st.integers(1, 4)))
    failing = data.draw(st.none() | st.sampled_from(names))
    sessions = data.draw(st.lists(st.tuples(st.sampled_from(names), st.integers(1, 5), st.integers(0, 12),
                                            st.none() | st.integers(0, 12)), min_size=1, max_size=8))
    engine_of: dict[str, str] = {}
    ended: dict[str, Status] = {}
    tokens: dict[str, list[int]] = {}
    seen = 0
    for it in range(80):
        for k, (e, max_tokens, start, cancel_at) in enumerate(sessions):
            sid = f"s{k}"
            if start == it:
                engine_of[sid], tokens[sid] = e, []
                t.push(opening(w, e, sid, max_tokens=max_tokens))
            if cancel_at == it and sid in engine_of and sid not in ended:
                t.cancel(sid)
        if failing is not None:
            engines[failing].fail = it % 3 == 1
        w.run_once()
        for a in t.answers[seen:]:
            r = a.result
            if r.status == Status.OK and r.token is not None:
                assert r.token == ENGINES[engine_of[r.session_id]][1], r  # computed by its own engine
                tokens[r.session_id].append(r.token)
            if r.finished or r.status != Status.OK:
                ended.setdefault(r.session_id, r.status)
            elif r.token is not None:
                t.push(decode(w, engine_of[r.session_id], r.session_id, r.position, r.token))
        seen = len(t.answers)
        if it > 12 and len(ended) == len(sessions):
            break
    for name, eng in engines.items():
        own = {*ENGINES[name][2], ENGINES[name][1]}
        assert all(set(call) <= own for call in eng.fed), name
    closed = {sid for sid, kind in t.closed}
    for sid, e in engine_of.items():
        assert sid in ended or sid in closed, f"{sid} on {e} never ended"
        if ended.get(sid) == Status.OK:
            assert len(tokens[sid]) == next(m for n, (_, m, _, _) in enumerate(sessions) if f"s{n}" == sid)
    w.flush()
    assert w.lanes.busy_slots() == 0, "a slot leaked"
    assert all(lane.hops.held() == 0 for lane in w.lanes)
