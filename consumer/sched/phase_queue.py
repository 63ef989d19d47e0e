"""One phase's queue inside a scheduler: the sessions whose head job is of that phase and ready to run, oldest
head first, and how many jobs and tokens of the phase wait (not yet handed out). The scheduler keeps one per
phase (consumer/sched/state.py) and picks between them by smooth weighted round-robin (round_robin.py).

A session leaves the queue lazily: its heap entry goes stale (its `ready_seq` no longer matches) and is dropped
when popped, or all at once when stale entries are more than half the heap."""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Generic, Protocol, TypeVar

from schemas import Phase

__all__ = ["PhaseQueue", "Queued"]

_COMPACT_AFTER = 64  # stale entries tolerated before a compaction is considered


class Queued(Protocol):
    """What a phase queue reads and marks of a session's queue (consumer/sched/state.py SessionQueue)."""

    ready_seq: int  # its head job's admission seq while it sits in a phase queue, else -1
    ready_phase: Phase | None

    @property
    def session_id(self) -> str: ...


S = TypeVar("S", bound=Queued)


class PhaseQueue(Generic[S]):
    __slots__ = ("heap", "jobs", "n_ready", "n_stale", "phase", "sessions", "tokens")

    def __init__(self, phase: Phase, sessions: Mapping[str, S]) -> None:
        self.phase = phase
        self.sessions = sessions  # the scheduler's open sessions, by id (read only: to tell a live entry)
        self.heap: list[tuple[int, str]] = []  # (head job's admission seq, session id)
        self.n_ready = 0  # live entries
        self.n_stale = 0
        self.jobs = 0  # jobs of this phase queued in any session
        self.tokens = 0  # their tokens not yet handed out (a decode job counts 1)

    def push(self, lane: S, seq: int) -> None:
        """The session is ready: its head job (of this phase, admitted as `seq`) waits to run."""
        heapq.heappush(self.heap, (seq, lane.session_id))
        lane.ready_seq = seq
        lane.ready_phase = self.phase
        self.n_ready += 1

    def remove(self, lane: S) -> None:
        """Take the session out (it must be in this queue)."""
        lane.ready_seq = -1
        lane.ready_phase = None
        self.n_ready -= 1
        self.n_stale += 1
        if self.n_stale > _COMPACT_AFTER and self.n_stale > len(self.heap) // 2:
            self.heap = [e for e in self.heap if self._is_live(e)]
            heapq.heapify(self.heap)
            self.n_stale = 0

    def pop(self) -> S | None:
        """The session whose head job was admitted first, taken out; None when none is ready."""
        heap = self.heap
        while heap:
            seq, sid = heapq.heappop(heap)
            lane = self.sessions.get(sid)
            if lane is None or lane.ready_seq != seq:
                self.n_stale = max(0, self.n_stale - 1)
                continue
            lane.ready_seq = -1
            lane.ready_phase = None
            self.n_ready -= 1
            return lane
        return None

    def _is_live(self, entry: tuple[int, str]) -> bool:
        lane = self.sessions.get(entry[1])
        return lane is not None and lane.ready_seq == entry[0]
