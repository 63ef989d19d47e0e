"""consumer.session_table: slots handed out and taken back explicitly, closed sessions remembered."""

from __future__ import annotations

import pytest

from consumer.sched.session_table import SessionState, SessionTable
from schemas import RouteHop, SessionSpec
from tests.support import compat_key

_KEY = compat_key("prefill", sha="0" * 64, ctx=64, runtime="test")


def spec(sid: str, account: str = "acct") -> SessionSpec:
    return SessionSpec(session_id=sid, account_id=account, route=(RouteHop(worker_id="w", key=_KEY),))


def test_open_hands_out_slots_in_order_and_never_evicts() -> None:
    t = SessionTable(3)
    entries = [t.open(spec(f"s{i}"), f"j{i}") for i in range(3)]
    assert [e.slot for e in entries if e is not None] == [0, 1, 2]
    assert t.open(spec("s3"), "j3") is None
    assert len(t) == 3 and all(f"s{i}" in t for i in range(3)) and "s3" not in t
    assert t.n_free == 0
    e = t.get("s1")
    assert e is not None and e.state == SessionState.PREFILLING and e.position == 0
    assert e.session_id == "s1" and e.account_id == "acct" and e.opening_job_id == "j1"
    assert t.session_at(1) == "s1"


def test_open_twice_is_a_bug() -> None:
    t = SessionTable(2)
    t.open(spec("a"), "j")
    with pytest.raises(ValueError):
        t.open(spec("a"), "j2")


def test_released_slot_is_dirty_until_cleared() -> None:
    t = SessionTable(1)
    e = t.open(spec("a"), "j")
    assert e is not None
    t.close("a", "finished")
    assert t.n_free == 0 and t.n_dirty == 1 and t.is_dirty(0) and t.busy_slots == 1
    assert t.open(spec("b"), "jb") is None  # dirty is not free
    assert t.drain_released() == [0]
    assert t.drain_released() == []
    assert t.open(spec("b"), "jb") is None  # drained but still not cleared
    t.slot_cleared(0)
    assert t.is_free(0) and t.n_dirty == 0 and t.busy_slots == 0
    b = t.open(spec("b"), "jb")
    assert b is not None and b.slot == 0


def test_slot_cleared_before_drain_is_not_reported_afterwards() -> None:
    t = SessionTable(2)
    t.open(spec("a"), "j")
    t.close("a", "cancelled")
    t.slot_cleared(0)
    assert t.drain_released() == []


def test_slot_misuse_raises() -> None:
    t = SessionTable(2)
    t.open(spec("a"), "j")
    with pytest.raises(ValueError):
        t.slot_cleared(0)  # held, not dirty
    with pytest.raises(ValueError):
        t.slot_cleared(1)  # free
    with pytest.raises(ValueError):
        t.release_slot(1)  # free
    with pytest.raises(ValueError):
        t.release_slot(0)  # held by an open session
    with pytest.raises(ValueError):
        t.release_slot(7)
    t.close("a", "finished")
    with pytest.raises(ValueError):
        t.release_slot(0)  # already dirty
    t.slot_cleared(0)
    with pytest.raises(ValueError):
        t.slot_cleared(0)


def test_close_can_defer_the_slot_release() -> None:
    t = SessionTable(1)
    t.open(spec("a"), "j")
    rec = t.close("a", "cancelled", release_slot=False)
    assert rec.slot == 0 and "a" not in t
    assert t.drain_released() == [] and t.n_free == 0 and not t.is_dirty(0)
    assert t.session_at(0) is None
    t.release_slot(0)
    assert t.drain_released() == [0]


def test_closed_sessions_are_remembered_failed_ones_forgotten() -> None:
    t = SessionTable(3)
    for sid in ("f", "c", "x"):
        e = t.open(spec(sid, account=f"acct-{sid}"), f"open-{sid}")
        assert e is not None
        e.queued_position = 12
        e.generated = 2
        e.prompt_tokens, e.generated_tokens, e.engine_seconds = 10, 2, 0.5
    fin = t.close("f", "finished")
    assert (fin.kind, fin.state, fin.position, fin.account_id) == ("finished", SessionState.FINISHED, 12, "acct-f")
    assert (fin.prompt_tokens, fin.generated_tokens, fin.engine_seconds, fin.generated) == (10, 2, 0.5, 2)
    t.close("c", "cancelled")
    t.close("x", "failed")
    f_rec, c_rec = t.closed("f"), t.closed("c")
    assert f_rec is not None and f_rec.state == SessionState.FINISHED
    assert c_rec is not None and c_rec.state == SessionState.CANCELLED and c_rec.opening_job_id == "open-c"
    assert t.closed("x") is None
    assert t.n_closed == 2


def test_closed_lru_is_bounded_and_refreshed_on_lookup() -> None:
    t = SessionTable(1, closed_capacity=2)
    for sid in ("a", "b"):
        t.open(spec(sid), "j")
        t.close(sid, "finished")
        t.slot_cleared(0)
    assert t.closed("a") is not None  # refresh a: b is now the oldest
    t.open(spec("c"), "j")
    t.close("c", "finished")
    t.slot_cleared(0)
    assert t.n_closed == 2
    assert t.closed("b") is None and t.closed("a") is not None and t.closed("c") is not None


def test_reopening_forgets_the_closed_record() -> None:
    t = SessionTable(1)
    t.open(spec("a"), "j1")
    t.close("a", "finished")
    t.slot_cleared(0)
    t.open(spec("a"), "j2")
    assert t.closed("a") is None and "a" in t


def test_zero_closed_capacity_remembers_nothing() -> None:
    t = SessionTable(1, closed_capacity=0)
    t.open(spec("a"), "j")
    t.close("a", "finished")
    assert t.closed("a") is None and t.n_closed == 0


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        SessionTable(0)
    with pytest.raises(ValueError):
        SessionTable(1, closed_capacity=-1)
