"""One phase's queue inside a scheduler: the sessions whose head job is of that phase and ready to run, oldest
head first, and how many jobs and tokens of the phase wait (not yet handed out). The scheduler keeps one per
phase (consumer/sched/state.py) and picks between them by smooth weighted round-robin (round_robin.py).

A session leaves the queue lazily: its heap entry goes stale (its `ready_seq` no longer matches) and is dropped
when popped, or all at once when stale entries are more than half the heap."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from schemas import Phase, StepJob

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

    # ---- what waits: changed only through these, by the scheduler's parts

    def add(self, job: StepJob) -> None:
        """A job of this phase is queued."""
        self.jobs += 1
        self.tokens += _left(job, 0)

    def take(self, tokens: int, *, job_done: bool) -> None:
        """`tokens` of a queued job were handed out (to a call, or restored from the prefix cache); `job_done`:
        its last ones (it leaves the queue)."""
        self.tokens -= tokens
        if job_done:
            self.jobs -= 1

    def drop(self, job: StepJob, consumed: int) -> None:
        """A queued job leaves unfinished (its session closed, or a stop ended it early)."""
        self.take(_left(job, consumed), job_done=True)

    # ---- which sessions are ready

    def push(self, session: S, seq: int) -> None:
        """The session is ready: its head job (of this phase, admitted as `seq`) waits to run."""
        heapq.heappush(self.heap, (seq, session.session_id))
        session.ready_seq = seq
        session.ready_phase = self.phase
        self.n_ready += 1

    def remove(self, session: S) -> None:
        """Take the session out (it must be in this queue)."""
        session.ready_seq = -1
        session.ready_phase = None
        self.n_ready -= 1
        self.n_stale += 1
        if self.n_stale > _COMPACT_AFTER and self.n_stale > len(self.heap) // 2:
            self.heap = [e for e in self.heap if self._is_live(e)]
            heapq.heapify(self.heap)
            self.n_stale = 0

    def take_out(self, session: S) -> None:
        """Take the session out (it must be in this queue): popped when it is the oldest (a chained call's sessions
        come out in order: no stale entry left behind), else removed."""
        heap = self.heap
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
            self.n_stale = max(0, self.n_stale - 1)
        if heap and heap[0][0] == session.ready_seq and heap[0][1] == session.session_id:
            heapq.heappop(heap)
            session.ready_seq = -1
            session.ready_phase = None
            self.n_ready -= 1
        else:
            self.remove(session)

    def take_all_out(self, sessions: Sequence[S]) -> bool:
        """Take these sessions out (each in this queue) when they are every session ready, all at once: the heap
        emptied, not popped entry by entry (a chained call adopts every ready decode session). False, nothing
        changed, when others are ready too (take_out each then)."""
        if len(sessions) != self.n_ready:
            return False
        for session in sessions:
            session.ready_seq = -1
            session.ready_phase = None
        self.heap.clear()  # what else it held was stale
        self.n_ready = self.n_stale = 0
        return True

    def pop(self) -> S | None:
        """The session whose head job was admitted first, taken out; None when none is ready."""
        heap = self.heap
        while heap:
            seq, sid = heapq.heappop(heap)
            session = self.sessions.get(sid)
            if session is None or session.ready_seq != seq:
                self.n_stale = max(0, self.n_stale - 1)
                continue
            session.ready_seq = -1
            session.ready_phase = None
            self.n_ready -= 1
            return session
        return None

    def _is_live(self, entry: tuple[int, str]) -> bool:
        session = self.sessions.get(entry[1])
        return session is not None and session.ready_seq == entry[0]


def _left(job: StepJob, consumed: int) -> int:
    """What a job still counts in its phase's tokens: a decode job 1 (whatever its n), a prefill job its tokens
    not handed out."""
    return 1 if job.phase == "decode" else len(job.tokens) - consumed
