"""Which session holds which sequence slot, where it stands, and what it has cost so far.

Pure bookkeeping: no I/O, no clock, no engine. Every operation is O(1) (amortised), whatever the
number of open or idle sessions in the table.

Slots are handed out and taken back explicitly. A released slot is *dirty*: the engine still holds
the old session's state in it. It becomes free again only after `slot_cleared(slot)`, which the
worker calls once `engine.release(slot)` returned. Nothing is ever evicted: with no free slot,
`open()` returns None and the caller answers Reason.CAPACITY.

Closed sessions (finished or cancelled) are remembered in a bounded LRU so that a late step for one
is answered FINISHED / CANCELLED instead of state_lost. A session closed because the engine failed
is forgotten outright: its state is gone, and a later step rightly gets state_lost.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from schemas import SessionSpec

__all__ = ["CloseKind", "ClosedSession", "SessionEntry", "SessionState", "SessionTable"]

CloseKind = Literal["finished", "cancelled", "failed"]

_FREE, _HELD, _DIRTY = 0, 1, 2


class SessionState(StrEnum):
    PREFILLING = "prefilling"  # opened; no token sampled since the last prefill without one
    DECODING = "decoding"  # its last step sampled a token: the next step is expected to be a decode
    FINISHED = "finished"  # max_tokens or a stop token reached
    CANCELLED = "cancelled"


@dataclass(slots=True, eq=False)
class SessionEntry:
    """One open session. Mutable; owned by the table and the scheduler."""

    spec: SessionSpec
    slot: int
    opening_job_id: str  # the job that opened it: its redelivery is a DUPLICATE, not ALREADY_OPEN
    state: SessionState = SessionState.PREFILLING
    position: int = 0  # next position the engine's slot holds (steps that completed)
    queued_position: int = 0  # next position counting the jobs admitted and not yet answered
    generated: int = 0  # tokens sampled so far (the max_tokens count)
    # Continuation jobs (a decode job with no token feeds the session's own last sampled token):
    last_token: int | None = None  # the last token sampled for it
    queued_samples: bool = False  # the last job admitted samples (a token will be known at queued_position)
    prompt_tokens: int = 0  # accounting tallies
    generated_tokens: int = 0
    engine_seconds: float = 0.0

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def account_id(self) -> str:
        return self.spec.account_id


@dataclass(frozen=True, slots=True)
class ClosedSession:
    """What is left of a session once it is closed (kept in the LRU, and reported by drain_closed)."""

    session_id: str
    account_id: str
    kind: CloseKind
    slot: int
    position: int  # the next position it would have accepted (its queued position at close)
    opening_job_id: str
    generated: int
    prompt_tokens: int
    generated_tokens: int
    engine_seconds: float

    @property
    def state(self) -> SessionState:
        return SessionState.FINISHED if self.kind == "finished" else SessionState.CANCELLED


class SessionTable:
    DEFAULT_CLOSED_CAPACITY = 100_000

    def __init__(self, n_slots: int, closed_capacity: int = DEFAULT_CLOSED_CAPACITY) -> None:
        if n_slots < 1:
            raise ValueError("n_slots must be >= 1")
        if closed_capacity < 0:
            raise ValueError("closed_capacity must be >= 0")
        self.n_slots = n_slots
        self.closed_capacity = closed_capacity
        self._sessions: dict[str, SessionEntry] = {}
        self._by_slot: dict[int, str] = {}
        # A min-heap: the lowest free slot is handed out first, so the slots in use stay packed from
        # 0. llama.cpp runs a per-sequence KV batch as one pass only over consecutive seq ids.
        self._free: list[int] = list(range(n_slots))
        self._slot_state = bytearray(n_slots)  # _FREE / _HELD / _DIRTY per slot
        self._n_dirty = 0
        self._released: dict[int, None] = {}  # dirty slots not yet drained by the worker (ordered)
        self._closed: OrderedDict[str, ClosedSession] = OrderedDict()
        self._per_account: dict[str, int] = {}  # open sessions per billing account

    # ---- sessions -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> SessionEntry | None:
        return self._sessions.get(session_id)

    def session_at(self, slot: int) -> str | None:
        return self._by_slot.get(slot)

    def open(self, spec: SessionSpec, opening_job_id: str) -> SessionEntry | None:
        """Give the session a free slot; None when none is free (never evicts).

        Opening a session forgets any closed record of the same id."""
        if spec.session_id in self._sessions:
            raise ValueError(f"session {spec.session_id!r} is already open")
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._slot_state[slot] = _HELD
        entry = SessionEntry(spec=spec, slot=slot, opening_job_id=opening_job_id)
        self._sessions[spec.session_id] = entry
        self._by_slot[slot] = spec.session_id
        self._closed.pop(spec.session_id, None)
        self._per_account[spec.account_id] = self._per_account.get(spec.account_id, 0) + 1
        return entry

    def account_sessions(self, account_id: str) -> int:
        """Open sessions of one billing account."""
        return self._per_account.get(account_id, 0)

    def close(self, session_id: str, kind: CloseKind, *, release_slot: bool = True) -> ClosedSession:
        """Close an open session. Finished / cancelled ones go to the LRU; failed ones are forgotten.

        With release_slot=False the slot stays taken (an engine call on it is still in flight) until
        the caller passes it to `release_slot`."""
        entry = self._sessions.pop(session_id)
        del self._by_slot[entry.slot]
        left = self._per_account[entry.account_id] - 1
        if left:
            self._per_account[entry.account_id] = left
        else:
            del self._per_account[entry.account_id]
        closed = ClosedSession(
            session_id=session_id, account_id=entry.account_id, kind=kind, slot=entry.slot,
            position=entry.queued_position, opening_job_id=entry.opening_job_id,
            generated=entry.generated, prompt_tokens=entry.prompt_tokens,
            generated_tokens=entry.generated_tokens, engine_seconds=entry.engine_seconds,
        )
        if kind != "failed":
            entry.state = closed.state
        if kind != "failed" and self.closed_capacity > 0:
            self._closed[session_id] = closed
            self._closed.move_to_end(session_id)
            if len(self._closed) > self.closed_capacity:
                self._closed.popitem(last=False)
        if release_slot:
            self.release_slot(entry.slot)
        return closed

    def remember_closed(self, closed: ClosedSession) -> None:
        """Record a session closed without ever holding a slot (cancelled before it opened), so its
        later steps are answered like those of any closed session."""
        if closed.session_id in self._sessions:
            raise ValueError(f"session {closed.session_id!r} is open")
        if self.closed_capacity > 0:
            self._closed[closed.session_id] = closed
            self._closed.move_to_end(closed.session_id)
            if len(self._closed) > self.closed_capacity:
                self._closed.popitem(last=False)

    def forget_closed(self, session_id: str) -> None:
        """Drop the closed record of a session (a newer attempt of it re-opens: consumer/sched/scheduler.py)."""
        self._closed.pop(session_id, None)

    def closed(self, session_id: str) -> ClosedSession | None:
        """The closed record of a recently closed session (refreshes its place in the LRU)."""
        rec = self._closed.get(session_id)
        if rec is not None:
            self._closed.move_to_end(session_id)
        return rec

    @property
    def n_closed(self) -> int:
        return len(self._closed)

    # ---- slots ----------------------------------------------------------------------------------

    def release_slot(self, slot: int) -> None:
        """Take a slot back from a closed session: it is dirty until `slot_cleared`."""
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range")
        if self._slot_state[slot] != _HELD:
            raise ValueError(f"slot {slot} is not in use")
        owner = self._by_slot.get(slot)
        if owner is not None:
            raise ValueError(f"slot {slot} is still held by open session {owner!r}")
        self._slot_state[slot] = _DIRTY
        self._n_dirty += 1
        self._released[slot] = None

    def drain_released(self) -> list[int]:
        """Slots released since the last call. Each stays dirty until `slot_cleared`."""
        out = list(self._released)
        self._released.clear()
        return out

    def slot_cleared(self, slot: int) -> None:
        """The engine forgot the slot's state: it is free again."""
        if not 0 <= slot < self.n_slots or self._slot_state[slot] != _DIRTY:
            raise ValueError(f"slot {slot} is not dirty")
        self._slot_state[slot] = _FREE
        self._released.pop(slot, None)  # cleared before being drained: never report it afterwards
        self._n_dirty -= 1
        heapq.heappush(self._free, slot)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def busy_slots(self) -> int:
        """Slots not free: held by a session, or dirty (released, not yet cleared)."""
        return self.n_slots - len(self._free)

    @property
    def n_dirty(self) -> int:
        return self._n_dirty

    def is_dirty(self, slot: int) -> bool:
        return 0 <= slot < self.n_slots and self._slot_state[slot] == _DIRTY

    def is_free(self, slot: int) -> bool:
        return 0 <= slot < self.n_slots and self._slot_state[slot] == _FREE
