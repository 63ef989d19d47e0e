"""PhaseQueue (consumer/sched/phase_queue.py) against a plain sorted list: pushes, pops, removals and `take_out`
(a pop when the session is the oldest, else a removal) in any order leave the same sessions ready, popped oldest
first, with n_ready counting them."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.sched.phase_queue import PhaseQueue
from schemas import Phase


@dataclass(eq=False)
class Lane:
    session_id: str
    ready_seq: int = -1
    ready_phase: Phase | None = None


ops = st.lists(st.tuples(st.sampled_from(["push", "pop", "remove", "take_out"]), st.integers(0, 9)), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_take_out_and_the_rest_keep_the_queue_as_a_sorted_list(steps: list[tuple[str, int]]) -> None:
    lanes = {f"s{i}": Lane(f"s{i}") for i in range(10)}
    q: PhaseQueue[Lane] = PhaseQueue("decode", lanes)
    ready: list[tuple[int, str]] = []  # the oracle: (seq, session) of the ready ones
    seq = 0
    for op, i in steps:
        lane = lanes[f"s{i}"]
        queued = lane.ready_phase is not None
        if op == "push" and not queued:
            seq += 1
            q.push(lane, seq)
            ready.append((seq, lane.session_id))
        elif op == "pop":
            got = q.pop()
            want = min(ready) if ready else None
            assert (got.session_id if got else None) == (want[1] if want else None)
            if want:
                ready.remove(want)
        elif op in ("remove", "take_out") and queued:
            getattr(q, op)(lane)
            ready.remove(next(e for e in ready if e[1] == lane.session_id))
            assert lane.ready_phase is None and lane.ready_seq == -1
        assert q.n_ready == len(ready)
    popped = []
    while (got := q.pop()) is not None:
        popped.append(got.session_id)
    assert popped == [n for _, n in sorted(ready)]


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(st.sets(st.integers(0, 9)), max_size=20))
def test_take_all_out_takes_every_ready_session_or_nothing(steps: list[tuple[str, int]],
                                                          groups: list[set[int]]) -> None:
    """take_all_out (a chained call adopting every ready session at once) between the other operations: with
    exactly the ready sessions it leaves the queue empty, with any other set of ready sessions it changes nothing
    (False); pops stay oldest first, n_ready right."""
    lanes = {f"s{i}": Lane(f"s{i}") for i in range(10)}
    q: PhaseQueue[Lane] = PhaseQueue("decode", lanes)
    ready: list[tuple[int, str]] = []
    seq = 0
    for n, (op, i) in enumerate(steps):
        lane = lanes[f"s{i}"]
        if op == "push" and lane.ready_phase is None:
            seq += 1
            q.push(lane, seq)
            ready.append((seq, lane.session_id))
        elif op in ("remove", "take_out") and lane.ready_phase is not None:
            getattr(q, op)(lane)
            ready.remove(next(e for e in ready if e[1] == lane.session_id))
        elif op == "pop":
            got = q.pop()
            if got is not None:
                ready.remove(min(ready))
        if groups and n % 7 == 0:
            group = groups[n % len(groups)]
            chosen = [lanes[s] for _, s in sorted(ready) if int(s[1:]) in group]
            whole = {lane.session_id for lane in chosen} == {s for _, s in ready}
            assert q.take_all_out(chosen) == whole
            if whole:
                assert all(lane.ready_phase is None and lane.ready_seq == -1 for lane in chosen)
                ready.clear()
        assert q.n_ready == len(ready)
    popped = []
    while (got := q.pop()) is not None:
        popped.append(got.session_id)
    assert popped == [s for _, s in sorted(ready)]
