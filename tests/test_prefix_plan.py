"""The scheduler's side of the prefix cache on a sliding-window engine (consumer/sched/prefix_plan.py), pure:
a cacheable prompt's piece ends on the window's edge only while that saves something. A later session whose
restore stops short of the edge (its first job ends there: the producer's chunks) computes across the edge in
one piece once the blocks up to it are held, instead of taking another prefill turn for the rest."""

from __future__ import annotations

from consumer.prefix import PrefixStore
from consumer.prefix.planner import PrefixPlanner
from consumer.sched import ScheduledBatch, Scheduler
from tests.test_scheduler import admit, make, opening, prefill, run

WINDOW = 64
PROMPT = tuple(range(3, 83))  # 80 tokens: a first job of 64 (the window) and a second of 16 that samples


def _scheduler() -> tuple[Scheduler, PrefixStore]:
    s = make(n_slots=2, ctx=256, max_tokens_per_call=128, vocab=100, prefill_budget=128)
    store = PrefixStore(1 << 20)
    s.prefix = PrefixPlanner(store, "00000000000000aa", "global", WINDOW)
    return s, store


def _open(s: Scheduler, sid: str) -> None:
    assert admit(s, opening(sid, PROMPT[:WINDOW], sample=False, max_tokens=4)) is None
    assert admit(s, prefill(sid, WINDOW, PROMPT[WINDOW:])) is None


def _call(s: Scheduler, store: PrefixStore) -> ScheduledBatch:
    """The next batch, run as the worker would: its saves stored after it."""
    b = s.next_batch()
    assert b is not None
    run(s, b)
    for save in b.saves:
        store.put(b"state", save.ids, save.n_tokens)
    return b


def test_a_piece_crosses_the_window_edge_once_the_blocks_up_to_it_are_held() -> None:
    s, store = _scheduler()
    _open(s, "a")
    first = _call(s, store)  # the first session: cut on the edge, saved there
    assert [it.n_tokens for it in first.items] == [WINDOW] and [x.n_tokens for x in first.saves] == [WINDOW]
    rest = _call(s, store)  # the rest, sampled; nothing saved past the edge (the slot could not be trimmed back)
    assert [it.n_tokens for it in rest.items] == [16] and not rest.saves
    _open(s, "b")
    b = _call(s, store)
    # restored up to its first job's end less two rows (48: three blocks), then 48..80 computed in one piece
    assert [r.hit.n_tokens for r in b.restores] == [48]
    assert sum(it.n_tokens for it in b.items if it.session_id == "b") == 32
    assert any(it.samples for it in b.items) and not b.saves
