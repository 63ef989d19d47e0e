"""The scheduler's state and the bookkeeping every part of it shares: lanes (a session's queue), the
ready heaps per phase, closures. The decisions live in admission.py, batching.py and
output_processor.py (one concern each, as SGLang splits its scheduler), the queries in scheduler.py."""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas import PHASES, Phase, Reason, Status, StepJob
from schemas.limits import ID_PATTERN, MAX_REASON_LEN

from .config import SchedulerConfig
from .outputs import Answer, Outcome, SchedulerStats
from .phase_queue import PhaseQueue
from .round_robin import SmoothRoundRobin
from .session_table import ClosedSession, CloseKind, SessionEntry, SessionState, SessionTable

__all__ = ["SchedulerState"]


@dataclass(slots=True, eq=False)
class _Queued:
    job: StepJob
    ref: object
    seq: int  # admission order, unique
    consumed: int = 0  # tokens handed to the engine so far
    in_flight: tuple[int, int] | None = None  # (offset, n_tokens) of its item in flight
    prompt_tokens: int = 0  # accounting accumulated over the job's items
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not computed
    prefill_calls: int = 0  # prefill calls its items ran in
    engine_seconds: float = 0.0
    answered: bool = False

    @property
    def restored_whole(self) -> bool:
        """A queued prefill job whose every token the prefix cache restored (a job handed to the engine whole
        leaves the queue): answered by an item of no rows in the call that computes the rows after it."""
        return self.job.phase == "prefill" and self.consumed == len(self.job.tokens)


@dataclass(slots=True, eq=False)
class SessionQueue:
    """A session's queue. Jobs are in position order (admission enforces contiguity)."""

    entry: SessionEntry
    jobs: deque[_Queued] = field(default_factory=deque)
    inflight: list[_Queued] = field(default_factory=list)
    ready_seq: int = -1  # seq of the head while it sits in a ready heap, else -1
    ready_phase: Phase | None = None
    closed: CloseKind | None = None  # closed while busy: slot released once nothing is in flight
    # The prefix cache (consumer/sched/prefix_plan.py): looked up once, the block root (None: not cached),
    # the tokens of the slot's cacheable positions from 0 on (prompt rows; decoded rows too under a recipe
    # that caches them), a restore to run before its first computed piece.
    prefix_checked: bool = False
    prefix_root: bytes | None = None
    cacheable: list[int] = field(default_factory=list)
    # Under a batch-invariant recipe: the input tokens of the positions decoded right after the cacheable ones,
    # recomputed as prompt rows when the session finishes (PrefixPlanner.refill_answer).
    answer: list[int] = field(default_factory=list)
    pending_restore: Any = None
    prefix_looked: tuple[int, int, int] | None = None  # what the last lookup saw (PrefixPlanning._prefix_open)
    parting: int = 0  # a piece ends here, where the prompt parts from one seen before: saved as a checkpoint
    greedy: bool | None = None  # its sampling is a plain greedy one (sched/chaining.py asks once: None, not yet)
    # entry.spec.session_id, kept: read several times per session per call (an attribute, not a property)
    session_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.session_id = self.entry.spec.session_id


_ID = re.compile(ID_PATTERN)


class SchedulerState:
    CLOSED_LOG_MAX = 10_000  # closures kept for drain_closed()

    def __init__(self, config: SchedulerConfig, worker_id: str, engine_digests: Mapping[Phase, str]) -> None:
        if not _ID.fullmatch(worker_id):
            raise ValueError(f"worker_id {worker_id!r} does not match {ID_PATTERN}")
        self.config = config
        self.worker_id = worker_id
        self.engine_digests: dict[Phase, str] = dict(engine_digests)
        if len(set(self.engine_digests.values())) != len(self.engine_digests):
            # Digests cover the phase; equal ones would let a step through on the other phase's stream.
            raise ValueError(f"engine digests must differ between phases: {self.engine_digests}")
        self.table = SessionTable(config.capacity.n_slots, config.closed_capacity)
        self.stats = SchedulerStats()
        self._lanes: dict[str, SessionQueue] = {}  # open sessions
        self._inflight: dict[int, SessionQueue] = {}  # slot -> lane with items in flight (open or closed)
        self._queues: dict[Phase, PhaseQueue[SessionQueue]] = {p: PhaseQueue(p, self._lanes) for p in PHASES}
        self._awaiting: set[str] = set()  # DECODING sessions with nothing queued nor in flight
        self._continuing: set[str] = set()  # sessions amid a continuation job (its next job is on its way)
        # decode, prefill (batching.TURN_ORDER): which phase the next call serves when both are ready
        self._phase_turns = SmoothRoundRobin((config.w_decode, config.w_prefill))
        # Prefill calls alternate: admission order, then the prompts with the fewest rows left first (batching.py)
        self._shortest_turn = False
        self._seq = 0
        # session id -> the attempt of the opening that opened it (open sessions and recently closed
        # ones, bounded like the closed LRU): a newer attempt's opening supersedes it (`supersede`).
        self._attempts: OrderedDict[str, int] = OrderedDict()
        # Bounded: a worker that never drains it loses the oldest (counted in stats.closed_dropped).
        self._closed_log: deque[ClosedSession] = deque(maxlen=self.CLOSED_LOG_MAX)
        # slot -> what the prefix cache keeps of a finished session before its slot is cleared: a Save (a recipe
        # that caches decoded positions), or the lane whose answer to refill (PrefixPlanning._prefix_closed,
        # Scheduler.finished_saves); dropped when the slot is.
        self._finished_saves: dict[int, Any] = {}

    # ---- answers --------------------------------------------------------------------------------

    def _result(self, job: StepJob, status: Status, reason: Reason | None, position: int, *,
                detail: str = "", token: int | None = None, finished: bool = False, q: _Queued | None = None,
                batch_size: int = 0, offset: int = 0) -> Outcome:
        """The outcome of `job` (or of its token `offset`); `q`: charge what the queued job computed."""
        # A continuation job's token `offset` and its ending answer have ids of their own (StepJob.answer_id).
        rid = job.answer_id(offset, status == Status.OK, duplicate=reason == Reason.DUPLICATE)
        return Outcome(rid, job.session_id, status, reason, position, detail[:MAX_REASON_LEN], token, finished,
                       q.prompt_tokens if q is not None else 0, q.engine_seconds if q is not None else 0.0,
                       batch_size, cached_tokens=q.cached_tokens if q is not None else 0,
                       prefill_calls=q.prefill_calls if q is not None else 0)

    def _reject(self, job: StepJob, ref: object, reason: Reason, position: int, account_id: str | None,
                detail: str, status: Status = Status.REJECTED) -> Answer:
        self.stats.rejected += 1
        if reason == Reason.CAPACITY:
            self.stats.rejected_capacity += 1
        return Answer(ref=ref, job=job, result=self._result(job, status, reason, position, detail=detail),
                     account_id=account_id, close=None)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def _push_ready(self, lane: SessionQueue) -> None:
        head = lane.jobs[0]
        self._queues[head.job.phase].push(lane, head.seq)

    def _unready(self, lane: SessionQueue) -> None:
        """Take the session out of its phase queue, if it is in one."""
        if lane.ready_phase is not None:
            self._queues[lane.ready_phase].remove(lane)

    def _pop_ready(self, phase: Phase) -> SessionQueue | None:
        return self._queues[phase].pop()

    def _refresh(self, lane: SessionQueue) -> None:
        """Re-derive the lane's place: in a ready heap, among the sessions awaiting decode, or neither."""
        sid = lane.session_id
        if lane.closed is not None or self._lanes.get(sid) is not lane:
            self._awaiting.discard(sid)
            return
        if lane.inflight:
            self._awaiting.discard(sid)
            return
        if lane.jobs:
            self._awaiting.discard(sid)
            if lane.ready_phase is None:
                self._push_ready(lane)
        elif lane.entry.state == SessionState.DECODING:
            self._awaiting.add(sid)
        else:
            self._awaiting.discard(sid)

    def _drop_queued(self, lane: SessionQueue) -> list[_Queued]:
        """Empty the lane's queue; the jobs not answered yet, to be answered by the caller."""
        self._unready(lane)
        self._continuing.discard(lane.session_id)
        dropped: list[_Queued] = []
        for q in lane.jobs:
            self._queues[q.job.phase].drop(q.job, q.consumed)
            if not q.answered:
                q.answered = True
                dropped.append(q)
        lane.jobs.clear()
        return dropped

    def _close(self, lane: SessionQueue, kind: CloseKind) -> None:
        sid = lane.session_id
        self._drop_restore(lane)
        self._unready(lane)
        self._awaiting.discard(sid)
        self._continuing.discard(sid)
        busy = bool(lane.inflight)
        self._prefix_closed(lane, kind, busy)
        closed = self.table.close(sid, kind, release_slot=not busy)
        del self._lanes[sid]
        lane.closed = kind
        if kind == "finished":
            self.stats.sessions_finished += 1
        elif kind == "cancelled":
            self.stats.sessions_cancelled += 1
        else:
            self.stats.sessions_failed += 1
        if len(self._closed_log) == self._closed_log.maxlen:
            self.stats.closed_dropped += 1
        self._closed_log.append(closed)

    def _prefix_closed(self, lane: SessionQueue, kind: CloseKind, busy: bool) -> None:
        """A closing session's prefix-cache save (PrefixPlanning overrides it; nothing without a cache)."""

    def _drop_restore(self, lane: SessionQueue) -> None:
        """A restore that will not run (its session closed first): its entry unpinned (prefix cache)."""
        hit = getattr(lane.pending_restore, "hit", None)
        planner = getattr(self, "prefix", None)
        if hit is not None and planner is not None:
            planner.store.let_go(hit)
        lane.pending_restore = None

    def _reject_queued(self, lane: SessionQueue, reason: Reason, detail: str) -> list[Answer]:
        """Answer every step still queued for the lane REJECTED with `reason` (they never run)."""
        entry = lane.entry
        answers = []
        for q in self._drop_queued(lane):
            self.stats.rejected += 1
            answers.append(Answer(ref=q.ref, job=q.job,
                                  result=self._result(q.job, Status.REJECTED, reason, entry.position, detail=detail),
                                  account_id=entry.account_id, close=None))
        return answers
