"""The scheduling core: which queued steps go into the next fused engine call. Pure and synchronous.

No I/O, no Redis, no engine, no sampler, no clock: the worker feeds it jobs (`admit`, `cancel`), asks
it for a call (`next_batch`), runs the engine and the sampler (consumer/sampler.py), and reports back
the sampled tokens (`update_from_output`) or the failure (`fail`). Everything it
decides comes back as plain frozen dataclasses, so it is unit-testable in microseconds (modelled on
vLLM v1's scheduler). Nothing in here scans the session table: every operation costs O(jobs
touched · log queued), whatever the number of idle sessions.

Phases and fairness
-------------------
A call is either all decode or all prefill (a FusedBatch has one phase). The phases that have work
ready are served by smooth weighted round-robin (nginx): every round each ready phase adds its
weight to its current weight, the largest current weight wins (decode on a tie) and loses the sum
of the ready phases' weights. A phase with nothing ready keeps its current weight untouched.

Bounds, with weights w_decode = a and w_prefill = b, while both phases stay backlogged:

* decode waits at most ceil(b / a) consecutive prefill calls, each of at most `prefill_budget`
  tokens (so a decoding session's step waits at most ceil(b / a) · prefill_budget prefill tokens,
  plus the decode calls ahead of it in its own queue);
* prefill waits at most ceil(a / b) consecutive decode calls, so it is served at least once in
  every a + b consecutive calls (exactly b times in each period of a + b calls of the pattern);
* both bounds are tight: a saturated run reaches them (defaults 4:1 give D D P D D, repeated);
* no session waits forever: decode is FIFO by admission (oldest queued first, `max_batch` sessions
  per call), prefill is FIFO by admission with chunking, and each phase is served within the
  bounds above. A stretch during which only one phase has work leaves both current weights
  untouched, so the bounds hold across such stretches too.

tests/test_scheduler_properties.py checks these bounds on the scheduler itself over random arrival
patterns.

Decode calls: up to `max_batch` sessions, oldest queued step first, one row each, every row wants
logits. A continuation job (StepJob.n > 1) stays at the head of its lane and gives one row per call,
its next offset re-queued behind the steps admitted meanwhile (so FIFO holds as if each token were a
step of its own); the row's input is the session's last sampled token (SessionEntry.last_token) unless
the job's first offset carries one. Each offset is answered under its own result id; the job's last
answer (its n-th token, a stop, max_tokens) is `final` (it acks the entry).

Prefill calls (chunked prefill, as in Sarathi-Serve): jobs in admission order, taking up to
`prefill_budget` tokens per call; a job longer than what is left of the budget is split across
calls (BatchItem.offset / n_tokens). Only the item that finishes a job with `job.sample` wants
logits, on its last row. A session's next prefill job may follow it in the same call (its
positions continue), unless the job before it samples.

In flight
---------
A session with an item in a call that was handed out and not yet completed / failed is *busy*: it
is not scheduled again until every item of that call for it is reported, so a failed call never
leaves a later call built on state that was rolled back. Every item of a ScheduledBatch must be
passed to exactly one `update_from_output` or `fail` (a batch may be split with `without` first, to retry or
bisect after an engine error). A session cancelled while busy keeps its slot until its items are
reported (then the slot is released), so `engine.release` never races an engine call on it.

Answers and closures
--------------------
Every admitted job gets exactly one `Answer`: decided without the engine (admission,
cancellation) or after a call. `close` ("finished" or "cancelled") is set on the one
answer that closed the session. A session closed with no answer to carry it (a cancel with nothing
queued) or closed because an engine call failed on it (answers FAILED, close None: the transport's
close marker knows only finished / cancelled) shows only in `drain_closed()`, which lists every
closure with its kind ("finished", "cancelled", "failed") and tallies.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from schemas import Accounting, Phase, Reason, Status, StepJob, StepResult
from schemas.limits import ID_PATTERN, MAX_REASON_LEN, MAX_TOKENS_PER_JOB

from .batch import EngineCapacity
from .config import WorkerSettings
from .prefill_shape import MIN_BUDGET, piece_rows
from .schedule_output import Answer, AnswerClose, BatchItem, ScheduledBatch, SchedulerStats
from .session_table import ClosedSession, CloseKind, SessionEntry, SessionState, SessionTable

__all__ = [
    "Answer", "AnswerClose", "BatchItem", "CloseKind", "ScheduledBatch", "Scheduler", "SchedulerConfig",
    "SchedulerStats",
]


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_batch` is clamped to n_slots and max_tokens_per_call, `prefill_budget` to
    max_tokens_per_call, so a config with defaults fits any engine. `prefill_budget` is at least
    MIN_BUDGET (3): a prompt is never computed one row at a time (consumer/prefill_shape.py)."""

    capacity: EngineCapacity  # n_slots, ctx_per_session, max_tokens_per_call, vocab_size
    # The defaults are the worker's (consumer/config.py), written once.
    max_batch: int = WorkerSettings.max_batch  # decode sessions per fused call
    prefill_budget: int = WorkerSettings.prefill_budget  # tokens per prefill call
    w_decode: int = WorkerSettings.w_decode
    w_prefill: int = WorkerSettings.w_prefill
    closed_capacity: int = SessionTable.DEFAULT_CLOSED_CAPACITY  # closed sessions remembered
    # Most sessions one billing account may hold open on this worker at once (0: no limit), so one
    # account cannot take every slot (docs/security.md, "Fair use of slots").
    max_slots_per_account: int = WorkerSettings.max_slots_per_account

    def __post_init__(self) -> None:
        cap = self.capacity
        if min(cap.n_slots, cap.ctx_per_session, cap.max_tokens_per_call, cap.vocab_size) < 1:
            raise ValueError(f"capacity fields must all be >= 1: {cap}")
        if self.max_batch < 1 or self.prefill_budget < 1:
            raise ValueError("max_batch and prefill_budget must be >= 1")
        if self.w_decode < 1 or self.w_prefill < 1:
            raise ValueError("w_decode and w_prefill must be >= 1")
        if self.closed_capacity < 0:
            raise ValueError("closed_capacity must be >= 0")
        if self.max_slots_per_account < 0:
            raise ValueError("max_slots_per_account must be >= 0")
        object.__setattr__(self, "max_batch", min(self.max_batch, cap.n_slots, cap.max_tokens_per_call))
        object.__setattr__(self, "prefill_budget",
                           min(max(self.prefill_budget, MIN_BUDGET), cap.max_tokens_per_call))


# ---- internal state ---------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Queued:
    job: StepJob
    ref: object
    seq: int  # admission order, unique
    consumed: int = 0  # tokens handed to the engine so far
    in_flight: tuple[int, int] | None = None  # (offset, n_tokens) of its item in flight
    prompt_tokens: int = 0  # accounting accumulated over the job's items
    engine_seconds: float = 0.0
    answered: bool = False


@dataclass(slots=True, eq=False)
class _Lane:
    """A session's queue. Jobs are in position order (admission enforces contiguity)."""

    entry: SessionEntry
    jobs: deque[_Queued] = field(default_factory=deque)
    inflight: list[_Queued] = field(default_factory=list)
    ready_seq: int = -1  # seq of the head while it sits in a ready heap, else -1
    ready_phase: Phase | None = None
    closed: CloseKind | None = None  # closed while busy: slot released once nothing is in flight

    @property
    def session_id(self) -> str:
        return self.entry.spec.session_id


_ID = re.compile(ID_PATTERN)
_PHASES: tuple[Phase, Phase] = ("decode", "prefill")


class Scheduler:
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
        self._lanes: dict[str, _Lane] = {}  # open sessions
        self._inflight: dict[int, _Lane] = {}  # slot -> lane with items in flight (open or closed)
        self._ready: dict[Phase, list[tuple[int, str]]] = {"decode": [], "prefill": []}
        self._n_ready: dict[Phase, int] = {"decode": 0, "prefill": 0}
        self._n_stale: dict[Phase, int] = {"decode": 0, "prefill": 0}
        self._queued_jobs: dict[Phase, int] = {"decode": 0, "prefill": 0}
        self._queued_tokens: dict[Phase, int] = {"decode": 0, "prefill": 0}  # not yet handed out
        self._awaiting: set[str] = set()  # DECODING sessions with nothing queued nor in flight
        self._continuing: set[str] = set()  # sessions amid a continuation job (its next job is on its way)
        self._current: dict[Phase, int] = {"decode": 0, "prefill": 0}  # smooth WRR state
        self._weight: dict[Phase, int] = {"decode": config.w_decode, "prefill": config.w_prefill}
        self._seq = 0
        # session id -> the attempt of the opening that opened it (open sessions and recently closed
        # ones, bounded like the closed LRU): a newer attempt's opening supersedes it (`supersede`).
        self._attempts: OrderedDict[str, int] = OrderedDict()
        # Bounded: a worker that never drains it loses the oldest (counted in stats.closed_dropped).
        self._closed_log: deque[ClosedSession] = deque(maxlen=self.CLOSED_LOG_MAX)

    # ---- answers --------------------------------------------------------------------------------

    def _result(self, job: StepJob, status: Status, reason: Reason | None, position: int, *,
                detail: str = "", token: int | None = None, finished: bool = False,
                accounting: Accounting | None = None, batch_size: int = 0, offset: int = 0) -> StepResult:
        # A continuation job's token `offset` and its ending answer have ids of their own (StepJob.answer_id).
        rid = job.answer_id(offset, status == Status.OK, duplicate=reason == Reason.DUPLICATE)
        return StepResult(
            job_id=rid, session_id=job.session_id, status=status, reason=reason,
            detail=detail[:MAX_REASON_LEN], position=position, token=token, finished=finished,
            accounting=accounting if accounting is not None else Accounting(),
            worker_id=self.worker_id, batch_size=batch_size,
        )

    def _reject(self, job: StepJob, ref: object, reason: Reason, position: int, account_id: str | None,
                detail: str, status: Status = Status.REJECTED) -> Answer:
        self.stats.rejected += 1
        return Answer(ref=ref, job=job, result=self._result(job, status, reason, position, detail=detail),
                     account_id=account_id, close=None)

    # ---- admission ------------------------------------------------------------------------------

    def admit(self, job: StepJob, stream_digest: str, ref: object) -> Answer | None:
        """Queue the job (None), or answer it at once. Checks, in this order, each with its own reason
        and no effect on any other session:

        1. job.compat == stream_digest == engine_digests[job.phase] (INCOMPATIBLE). Digests include
           the phase, so this also checks that the stream is the job's phase; with the session's
           spec known (the opening job's, or the open session's): job.hop is on its route and that
           hop's worker is this worker (WRONG_HOP); then, for a recently cancelled session, any job
           but its opening again: status CANCELLED (a cancel is final);
        2. position against the session's next position counting queued jobs: lower DUPLICATE,
           higher POSITION_GAP; a prefill at 0 for a known session: DUPLICATE if it is the opening
           job again, ALREADY_OPEN if the session is open (a closed one goes on to check 5);
        3. every token < vocab_size (BAD_TOKEN);
        4. end position <= ctx_per_session and len(tokens) <= MAX_TOKENS_PER_JOB (TOO_LONG);
        5. recently cancelled: status CANCELLED; recently finished: REJECTED FINISHED;
        6. a prefill at 0 opens the session (ACCOUNT_LIMIT when its billing account holds
           config.max_slots_per_account open sessions, CAPACITY when no slot is free); any other step
           for a session this worker does not hold: STATE_LOST UNKNOWN_SESSION.

        result.position is the session's next position counting queued jobs (job.start_position
        for a session it does not know). A reply for a session this worker never held names no
        billing account: a rejected opening costs nothing and must leave no per-account record
        (otherwise any writer could mint accounts without bound).
        """
        sid = job.session_id
        entry = self.table.get(sid)
        closed = self.table.closed(sid) if entry is None else None
        opening = job.phase == "prefill" and job.start_position == 0
        account: str | None
        if entry is not None:
            next_pos, account = entry.queued_position, entry.account_id
        elif closed is not None:
            next_pos, account = closed.position, closed.account_id
        else:
            next_pos, account = job.start_position, None

        engine_digest = self.engine_digests.get(job.phase)
        if engine_digest is None or not (job.compat == stream_digest == engine_digest):
            return self._reject(job, ref, Reason.INCOMPATIBLE, next_pos, account,
                                f"job compat {job.compat}, stream {stream_digest}, engine "
                                f"{job.phase} {engine_digest}")
        spec = entry.spec if entry is not None else job.session if closed is None else None
        route = spec.route if spec is not None else None
        if route is not None and (job.hop >= len(route) or route[job.hop].worker_id != self.worker_id):
            return self._reject(job, ref, Reason.WRONG_HOP, next_pos, account,
                                f"hop {job.hop} is not this worker's on the session's route")
        if route is not None and len(route) > 1 and job.n > 1:
            # Refused, not clamped: each token of a route of several hops travels back to hop 0 first.
            return self._reject(job, ref, Reason.WRONG_HOP, next_pos, account,
                                "a continuation (n > 1) needs a route of one hop")

        held_attempt = self._attempts.get(sid) if entry is not None else None
        if held_attempt is not None and job.attempt < held_attempt:
            # A step of an attempt this worker dropped for a newer one (a route replay): never computed.
            return self._reject(job, ref, Reason.DUPLICATE, next_pos, account,
                                f"attempt {job.attempt} is older than the session's attempt {held_attempt}")
        known = entry if entry is not None else closed
        if closed is not None and closed.kind == "cancelled" and job.job_id != closed.opening_job_id:
            # A cancel is final whatever the step's position: a later prompt chunk or a replay's new
            # attempt of a cancelled session is answered CANCELLED, never POSITION_GAP or a fresh open.
            return self._reject(job, ref, Reason.CANCELLED, next_pos, account, "session was cancelled",
                                status=Status.CANCELLED)
        if known is not None:
            if opening:
                if job.job_id == known.opening_job_id:
                    return self._reject(job, ref, Reason.DUPLICATE, next_pos, account,
                                        "the opening prefill was already received")
                if entry is not None:
                    return self._reject(job, ref, Reason.ALREADY_OPEN, next_pos, account,
                                        "session is already open")
            elif job.start_position < next_pos:
                return self._reject(job, ref, Reason.DUPLICATE, next_pos, account,
                                    f"position {job.start_position} < next position {next_pos}")
            elif job.start_position > next_pos:
                return self._reject(job, ref, Reason.POSITION_GAP, next_pos, account,
                                    f"position {job.start_position} > next position {next_pos}")
        if entry is not None and not job.tokens and not entry.queued_samples:
            # A job with no token feeds the token sampled at its position: none is sampled there.
            return self._reject(job, ref, Reason.POSITION_GAP, next_pos, account,
                                f"no token is sampled at position {job.start_position} to continue from")

        cap = self.config.capacity
        top = max(job.tokens, default=0)
        if top >= cap.vocab_size:
            return self._reject(job, ref, Reason.BAD_TOKEN, next_pos, account,
                                f"token {top} >= vocab_size {cap.vocab_size}")
        if job.end_position > cap.ctx_per_session or len(job.tokens) > MAX_TOKENS_PER_JOB:
            return self._reject(job, ref, Reason.TOO_LONG, next_pos, account,
                                f"end position {job.end_position} > ctx_per_session {cap.ctx_per_session}"
                                if job.end_position > cap.ctx_per_session
                                else f"{len(job.tokens)} tokens > {MAX_TOKENS_PER_JOB}")

        if closed is not None:
            if closed.kind == "cancelled":
                return self._reject(job, ref, Reason.CANCELLED, next_pos, account, "session was cancelled",
                                    status=Status.CANCELLED)
            return self._reject(job, ref, Reason.FINISHED, next_pos, account, "session has finished")

        if entry is None:
            if not opening:
                return self._reject(job, ref, Reason.UNKNOWN_SESSION, next_pos, account,
                                    "this worker does not hold the session", status=Status.STATE_LOST)
            assert job.session is not None  # StepJob guarantees it on the opening prefill
            limit = self.config.max_slots_per_account
            if limit and self.table.account_sessions(job.session.account_id) >= limit:
                return self._reject(job, ref, Reason.ACCOUNT_LIMIT, next_pos, account,
                                    f"account {job.session.account_id} holds {limit} sessions on this worker")
            entry = self.table.open(job.session, job.job_id)
            if entry is None:
                return self._reject(job, ref, Reason.CAPACITY, next_pos, account,
                                    f"all {cap.n_slots} slots are taken")
            self.stats.sessions_opened += 1
            self._lanes[sid] = _Lane(entry=entry)
            self._attempts[sid] = job.attempt
            self._attempts.move_to_end(sid)
            while len(self._attempts) > self.config.closed_capacity + cap.n_slots:
                self._attempts.popitem(last=False)

        lane = self._lanes[sid]
        self._seq += 1
        lane.jobs.append(_Queued(job=job, ref=ref, seq=self._seq))
        entry.queued_position = job.end_position
        entry.queued_samples = job.sample
        self._queued_jobs[job.phase] += 1
        self._queued_tokens[job.phase] += 1 if job.phase == "decode" else len(job.tokens)
        self.stats.admitted += 1
        self._refresh(lane)
        return None

    # ---- a newer attempt ------------------------------------------------------------------------

    def supersede(self, job: StepJob, stream_digest: str) -> list[Answer]:
        """Before admitting `job`: when it opens (prefill at 0, a compatible key) a newer attempt of a
        session this scheduler holds or recently finished, drop the older attempt, so admit() opens
        the new one. On a route of several hops a lost state on ANY hop makes the Tracker replay every
        hop of the route (attempt + 1), and the hops that did not lose it still hold the older attempt.
        Its queued steps are answered REJECTED already_open ("superseded"); its state is forgotten with
        no accounting closure (the session goes on, under its new attempt). A cancelled session stays
        cancelled; an older or equal attempt changes nothing; a session with a call in flight is left
        as is (admit answers already_open). Returns the answers of the dropped steps."""
        sid = job.session_id
        if not (job.phase == "prefill" and job.start_position == 0 and job.attempt > 0):
            return []
        if job.compat != stream_digest or job.compat != self.engine_digests.get(job.phase):
            return []
        held = self._attempts.get(sid)
        if held is None or job.attempt <= held:
            return []
        lane = self._lanes.get(sid)
        if lane is None:
            closed = self.table.closed(sid)
            if closed is not None and closed.kind == "finished":
                self.table.forget_closed(sid)
                del self._attempts[sid]
            return []
        if lane.inflight or lane.entry.opening_job_id == job.job_id:
            return []
        answers = self._reject_queued(lane, Reason.ALREADY_OPEN, f"superseded by attempt {job.attempt} of the session")
        self._unready(lane)
        self._awaiting.discard(sid)
        self.table.close(sid, "failed")  # forgotten outright (no closed record), the slot released
        del self._lanes[sid]
        del self._attempts[sid]
        lane.closed = "failed"
        return answers

    # ---- cancellation ---------------------------------------------------------------------------

    def cancel(self, session_id: str) -> list[Answer]:
        """Answer the session's queued jobs CANCELLED (they never run) and close it 'cancelled'.

        The last Answer carries close='cancelled'; with nothing queued the result is [] and the
        closure shows only in drain_closed(). Jobs already in a call are answered CANCELLED when the
        call is reported, and the slot is released then. Unknown or closed session: []."""
        lane = self._lanes.get(session_id)
        if lane is None:
            return []
        entry = lane.entry
        answers: list[Answer] = []
        for q in self._drop_queued(lane):
            self.stats.jobs_cancelled += 1
            answers.append(Answer(
                ref=q.ref, job=q.job,
                result=self._result(q.job, Status.CANCELLED, Reason.CANCELLED, entry.position,
                                    detail="session cancelled before the step ran",
                                    accounting=self._job_accounting(q, generated=0)),
                account_id=entry.account_id, close=None))
        self._close(lane, "cancelled")
        if answers:
            answers[-1] = replace(answers[-1], close="cancelled")
        return answers

    def refuse_cancelled(self, job: StepJob, ref: object) -> Answer:
        """Answer a step of a session this scheduler does not hold whose cancellation was recorded
        before the step was admitted (a cancel marker): its opening (cancelled before it was read), or
        any later step (cancelled while an earlier worker held it). CANCELLED with close='cancelled',
        no slot taken, and the session remembered as closed-cancelled, so its other steps are
        answered CANCELLED too."""
        account = job.session.account_id if job.session is not None else ""
        opening = job.phase == "prefill" and job.start_position == 0
        if self.table.get(job.session_id) is None:
            self.table.remember_closed(ClosedSession(
                session_id=job.session_id, account_id=account, kind="cancelled", slot=-1,
                position=job.end_position, opening_job_id=job.job_id if opening else "", generated=0,
                prompt_tokens=0, generated_tokens=0, engine_seconds=0.0))
            self.stats.sessions_cancelled += 1
        self.stats.jobs_cancelled += 1
        result = self._result(job, Status.CANCELLED, Reason.CANCELLED, job.start_position,
                              detail="session was cancelled before this step was admitted")
        return Answer(ref=ref, job=job, result=result, account_id=account or None, close="cancelled")

    # ---- scheduling -----------------------------------------------------------------------------

    def _pick_phase(self) -> Phase | None:
        ready_d = self._n_ready["decode"] > 0
        ready_p = self._n_ready["prefill"] > 0
        if not (ready_d and ready_p):
            return "decode" if ready_d else "prefill" if ready_p else None
        cur, w = self._current, self._weight
        cur["decode"] += w["decode"]
        cur["prefill"] += w["prefill"]
        phase: Phase = "decode" if cur["decode"] >= cur["prefill"] else "prefill"
        cur[phase] -= w["decode"] + w["prefill"]
        return phase

    def next_batch(self) -> ScheduledBatch | None:
        """The next fused call, or None when nothing is ready. See the module docstring."""
        while True:
            before = dict(self._current)
            phase = self._pick_phase()
            if phase is None:
                return None
            items = self._take_decode() if phase == "decode" else self._take_prefill()
            if items:
                break
            # Every ready prefill session waits for more of its prompt (and left the ready heap): the
            # round did not happen, so the weights are as they were; pick again.
            self._current = before
        batch = ScheduledBatch.build(phase, items)
        if phase == "decode":
            self.stats.calls_decode += 1
            self.stats.rows_decode += len(batch.fused)
        else:
            self.stats.calls_prefill += 1
            self.stats.rows_prefill += len(batch.fused)
        return batch

    def _take_decode(self) -> list[BatchItem]:
        items: list[BatchItem] = []
        while len(items) < self.config.max_batch:
            lane = self._pop_ready("decode")
            if lane is None:
                break
            # A continuation job (n > 1) stays at the head of its lane until its last offset is handed
            # out: each call takes its next offset, feeding the token the session sampled last.
            q = lane.jobs[0]
            offset = q.consumed
            token = None if offset == 0 and q.job.tokens else lane.entry.last_token
            q.consumed = offset + 1
            q.in_flight = (offset, 1)
            if q.consumed >= q.job.n:
                lane.jobs.popleft()
                self._queued_jobs["decode"] -= 1
                self._queued_tokens["decode"] -= 1
                self._continuing.discard(lane.session_id)
            else:  # its next offset queues behind the steps admitted meanwhile, as a new step would
                self._seq += 1
                q.seq = self._seq
                self._continuing.add(lane.session_id)
            lane.inflight.append(q)
            self._inflight[lane.entry.slot] = lane
            items.append(BatchItem(ref=q.ref, job=q.job, slot=lane.entry.slot, offset=offset, n_tokens=1,
                                   row_start=len(items), samples=True, sampling=lane.entry.spec.sampling,
                                   token=token))
        return items

    def _take_prefill(self) -> list[BatchItem]:
        """Prefill pieces in admission order up to the budget. Each session takes one piece, which may
        span several of its queued jobs and is sized by consumer/prefill_shape.py (no single prompt row
        left behind, replayed generated tokens one at a time), so its numbers do not depend on how the
        prompt was cut. A session that cannot take a piece until more of its prompt arrives waits out of
        the ready heap (admit() puts it back)."""
        items: list[BatchItem] = []
        full = self.config.prefill_budget
        budget = full
        rows = 0
        while budget > 0:
            lane = self._pop_ready("prefill")
            if lane is None:
                break
            start, queued_end, prompt_end = self._prefill_extent(lane)
            if full < MIN_BUDGET:  # an engine that takes fewer rows per call: no shape rule possible
                n = min(budget, queued_end - start)
            else:
                n = piece_rows(start, budget, queued_end, prompt_end)
            if n == 0:
                if piece_rows(start, full, queued_end, prompt_end) > 0:
                    self._push_ready(lane)  # it fits a call of its own: first in the next one
                    break
                continue  # waits for more of its prompt
            rows = self._take_piece(lane, n, rows, items)
            budget -= n
        return items

    def _prefill_extent(self, lane: _Lane) -> tuple[int, int, int | None]:
        """(next position, end of the queued prefill tokens that follow on, where the prompt ends or None)."""
        head = lane.jobs[0]
        start = head.job.start_position + head.consumed
        queued_end = start
        sampled_end: int | None = None  # where a sampling job (or a decode step) ends the prefill
        for q in lane.jobs:
            if q.job.start_position + q.consumed != queued_end:
                break
            if q.job.phase != "prefill":  # a decode step follows on: the prompt ends here
                sampled_end = queued_end
                break
            queued_end = q.job.end_position
            if q.job.sample:
                sampled_end = queued_end
                break
        prompt_end = lane.entry.spec.prompt_len
        if sampled_end is not None:
            prompt_end = sampled_end if prompt_end is None else min(prompt_end, sampled_end)
        return start, queued_end, prompt_end

    def _take_piece(self, lane: _Lane, n: int, rows: int, items: list[BatchItem]) -> int:
        """Hand the lane's next n prefill tokens to the call, across its jobs; returns the rows so far."""
        while n > 0:
            q = lane.jobs[0]
            offset = q.consumed
            k = min(len(q.job.tokens) - offset, n)
            done = offset + k == len(q.job.tokens)
            q.consumed = offset + k
            q.in_flight = (offset, k)
            self._queued_tokens["prefill"] -= k
            if done:
                lane.jobs.popleft()
                self._queued_jobs["prefill"] -= 1
            lane.inflight.append(q)
            self._inflight[lane.entry.slot] = lane
            samples = done and q.job.sample
            items.append(BatchItem(ref=q.ref, job=q.job, slot=lane.entry.slot, offset=offset, n_tokens=k,
                                   row_start=rows, samples=samples,
                                   sampling=lane.entry.spec.sampling if samples else None))
            rows += k
            n -= k
        return rows

    # ---- reports --------------------------------------------------------------------------------

    def update_from_output(self, batch: ScheduledBatch, tokens: Sequence[int | None], engine_seconds: float,
                           ) -> list[Answer]:
        """Apply a successful call. `tokens`: the sampler's token for every item that samples, in item
        order (consumer/sampler.py: keyed by the session's seed and the position the token takes).
        None for every item on a route hop that is not last (it answers activations, the last hop
        samples): the step counts as the one the last hop samples at (so the hop finishes the session
        at max_tokens, as the last hop does; a stop token only the last hop sees), no token, nothing
        generated is charged.

        Positions advance; engine_seconds is split over the items by n_tokens. A job's result carries
        its whole accounting: prompt_tokens = its tokens processed in prefill calls, generated_tokens =
        1 when a token was sampled. A session finishes when its generated count reaches max_tokens or
        the token is a stop token: result.finished, close='finished', slot released, and any step
        still queued for it answered REJECTED FINISHED. Items that do not finish their job produce no
        answer.
        """
        n_sampling = sum(1 for it in batch.items if it.samples)
        if len(tokens) != n_sampling:
            raise ValueError(f"{len(tokens)} tokens for {n_sampling} sampling items")
        seconds = engine_seconds if math.isfinite(engine_seconds) and engine_seconds > 0 else 0.0
        total_rows = max(1, len(batch.fused))
        batch_size = len(batch.session_ids)
        out: list[Answer] = []
        touched: dict[int, _Lane] = {}
        sampled = -1
        for it in batch.items:
            if it.samples:
                sampled += 1
            lane, q = self._claim(it)
            if lane is None or q is None:
                continue
            touched[it.slot] = lane
            share = seconds * it.n_tokens / total_rows
            # a decode job's answer carries its own call's share (one answer per offset)
            q.engine_seconds = share if batch.phase == "decode" else q.engine_seconds + share
            if batch.phase == "prefill":
                q.prompt_tokens += it.n_tokens
            reached = it.first_position + it.n_tokens
            if lane.closed is not None:  # closed while the call ran
                if it.completes_job and not q.answered:
                    out.append(self._closed_answer(lane, q, reached, batch_size))
                continue
            entry = lane.entry
            entry.position = reached
            entry.engine_seconds += share
            if batch.phase == "prefill":
                entry.prompt_tokens += it.n_tokens
            if not it.completes_job:
                continue
            token: int | None = None
            finished = False
            if it.samples:
                got = tokens[sampled]
                token = None if got is None else int(got)
                entry.generated += 1
                entry.last_token = token
                entry.state = SessionState.DECODING
                if token is not None:
                    entry.generated_tokens += 1
                    self.stats.tokens_sampled += 1
                finished = entry.generated >= entry.spec.max_tokens or (
                    token is not None and token in entry.spec.stop_tokens)
            elif batch.phase == "prefill":
                entry.state = SessionState.PREFILLING
            final = finished or batch.phase != "decode" or it.offset + 1 >= q.job.n
            if final and finished and lane.jobs and lane.jobs[0] is q:
                # A stop or max_tokens ends a continuation early: its unused offsets are dropped (no
                # answer, no charge), not answered FINISHED like a later job.
                lane.jobs.popleft()
                self._queued_jobs["decode"] -= 1
                self._queued_tokens["decode"] -= 1
                self._continuing.discard(lane.session_id)
            q.answered = final
            self.stats.jobs_ok += 1
            result = self._result(q.job, Status.OK, None, reached, token=token, finished=finished,
                                  accounting=self._job_accounting(q, generated=1 if token is not None else 0),
                                  batch_size=batch_size, offset=it.offset if batch.phase == "decode" else 0)
            out.append(Answer(ref=q.ref, job=q.job, result=result, account_id=entry.account_id,
                               close="finished" if finished else None, final=final))
            if batch.phase == "decode":
                q.engine_seconds = 0.0  # charged with this answer; a later answer carries its own
            if finished:
                out.extend(self._finish(lane, batch_size))
        self._settle(touched)
        return out

    def fail(self, batch: ScheduledBatch, reason_detail: str) -> list[Answer]:
        """The call failed: every item's job is answered FAILED (ENGINE_ERROR) and its session closed
        (forgotten: a later step gets state_lost), since the state it holds is unreliable. Steps
        still queued for those sessions are answered FAILED too. The answers carry close=None; the
        closures (kind 'failed') show in drain_closed()."""
        out: list[Answer] = []
        touched: dict[int, _Lane] = {}
        batch_size = len(batch.session_ids)
        failing: dict[int, _Lane] = {}
        per_lane: dict[int, list[Answer]] = {}
        for it in batch.items:
            lane, q = self._claim(it)
            if lane is None or q is None:
                continue
            touched[it.slot] = lane
            if q.answered:
                continue
            if lane.closed is not None:
                out.append(self._closed_answer(lane, q, lane.entry.position, batch_size))
                continue
            failing[it.slot] = lane
            per_lane.setdefault(it.slot, []).append(self._failed(lane, q, reason_detail, batch_size))
        for slot, lane in failing.items():
            answers = per_lane[slot]
            for q in self._drop_queued(lane):
                answers.append(self._failed(lane, q, "session closed: an engine call failed on it",
                                            batch_size))
            self._close(lane, "failed")
            out.extend(answers)
        self._settle(touched)
        return out

    # ---- worker-facing queries ------------------------------------------------------------------

    def set_prefill_budget(self, tokens: int) -> None:
        """Token budget of the next prefill calls (the worker sizes them by time: consumer/pacing.py).
        Clamped like the configured one; the fairness bounds hold for any budget."""
        if tokens != self.config.prefill_budget:
            self.config = replace(self.config, prefill_budget=max(MIN_BUDGET, tokens))

    def want(self) -> dict[Phase, int]:
        """How many new stream entries to read per phase.

        decode: the decoding sessions that have no step queued, and those amid a continuation job
        (their next job is pushed ahead), up to two calls' worth of queued decode steps (at least 1
        while under that cap, so steps for sessions this worker does not hold are still read and
        answered state_lost).
        prefill: 0 while two calls' worth of prefill tokens are queued, else enough entries to
        bring the queued prefill jobs up to max_batch (at least 1).
        """
        cfg = self.config
        room = 2 * cfg.max_batch - self._queued_jobs["decode"]
        decode = max(1, min(len(self._awaiting) + len(self._continuing), room)) if room > 0 else 0
        if self._queued_tokens["prefill"] >= 2 * cfg.prefill_budget:
            prefill = 0
        else:
            prefill = max(1, cfg.max_batch - self._queued_jobs["prefill"])
        return {"decode": decode, "prefill": prefill}

    def session_busy(self, session_id: str) -> bool:
        """Whether the open session has a step queued or in a call (so it is not idle)."""
        lane = self._lanes.get(session_id)
        return lane is not None and bool(lane.jobs or lane.inflight)

    def is_awaiting(self, session_id: str) -> bool:
        """Whether the session is decoding with no step queued nor in flight (it holds no credit)."""
        return session_id in self._awaiting

    def awaiting_decode(self) -> int:
        """Decoding sessions with no step queued nor in flight."""
        return len(self._awaiting)

    def has_work(self) -> bool:
        """Whether next_batch() would return a call now."""
        return self._n_ready["decode"] > 0 or self._n_ready["prefill"] > 0

    def ready(self, phase: Phase) -> int:
        """Sessions whose next step, in this phase, could go into a call now."""
        return self._n_ready[phase]

    def queued(self, phase: Phase | None = None) -> int:
        """Jobs admitted and not yet fully handed to the engine."""
        if phase is None:
            return self._queued_jobs["decode"] + self._queued_jobs["prefill"]
        return self._queued_jobs[phase]

    def in_flight(self) -> int:
        """Sessions with items in a call not yet reported."""
        return len(self._inflight)

    def drain_released(self) -> list[int]:
        """Slots released since the last call: call engine.release on each, then slot_cleared."""
        return self.table.drain_released()

    def slot_cleared(self, slot: int) -> None:
        self.table.slot_cleared(slot)

    def drain_closed(self) -> list[ClosedSession]:
        """Every session closed since the last call (finished, cancelled, failed), with its tallies."""
        out = list(self._closed_log)
        self._closed_log.clear()
        return out

    # ---- internals ------------------------------------------------------------------------------

    def _job_accounting(self, q: _Queued, generated: int) -> Accounting:
        return Accounting(prompt_tokens=q.prompt_tokens, generated_tokens=generated,
                          engine_seconds=q.engine_seconds)

    def _push_ready(self, lane: _Lane) -> None:
        head = lane.jobs[0]
        phase = head.job.phase
        heapq.heappush(self._ready[phase], (head.seq, lane.session_id))
        lane.ready_seq = head.seq
        lane.ready_phase = phase
        self._n_ready[phase] += 1

    def _unready(self, lane: _Lane) -> None:
        """Take the lane out of its ready heap (lazily: the heap entry goes stale)."""
        phase = lane.ready_phase
        if phase is None:
            return
        lane.ready_seq = -1
        lane.ready_phase = None
        self._n_ready[phase] -= 1
        self._n_stale[phase] += 1
        heap = self._ready[phase]
        if self._n_stale[phase] > 64 and self._n_stale[phase] > len(heap) // 2:
            self._ready[phase] = [e for e in heap if self._is_live(e)]
            heapq.heapify(self._ready[phase])
            self._n_stale[phase] = 0

    def _is_live(self, entry: tuple[int, str]) -> bool:
        lane = self._lanes.get(entry[1])
        return lane is not None and lane.ready_seq == entry[0]

    def _pop_ready(self, phase: Phase) -> _Lane | None:
        heap = self._ready[phase]
        while heap:
            seq, sid = heapq.heappop(heap)
            lane = self._lanes.get(sid)
            if lane is None or lane.ready_seq != seq:
                self._n_stale[phase] = max(0, self._n_stale[phase] - 1)
                continue
            lane.ready_seq = -1
            lane.ready_phase = None
            self._n_ready[phase] -= 1
            return lane
        return None

    def _refresh(self, lane: _Lane) -> None:
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

    def _drop_queued(self, lane: _Lane) -> list[_Queued]:
        """Empty the lane's queue; the jobs not answered yet, to be answered by the caller."""
        self._unready(lane)
        self._continuing.discard(lane.session_id)
        dropped: list[_Queued] = []
        for q in lane.jobs:
            phase = q.job.phase
            self._queued_jobs[phase] -= 1
            self._queued_tokens[phase] -= 1 if phase == "decode" else len(q.job.tokens) - q.consumed
            if not q.answered:
                q.answered = True
                dropped.append(q)
        lane.jobs.clear()
        return dropped

    def _close(self, lane: _Lane, kind: CloseKind) -> None:
        sid = lane.session_id
        self._unready(lane)
        self._awaiting.discard(sid)
        self._continuing.discard(sid)
        busy = bool(lane.inflight)
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

    def _finish(self, lane: _Lane, batch_size: int) -> list[Answer]:
        answers = self._reject_queued(lane, Reason.FINISHED, "session finished before this step")
        self._close(lane, "finished")
        return answers

    def _reject_queued(self, lane: _Lane, reason: Reason, detail: str) -> list[Answer]:
        """Answer every step still queued for the lane REJECTED with `reason` (they never run)."""
        entry = lane.entry
        answers = []
        for q in self._drop_queued(lane):
            self.stats.rejected += 1
            answers.append(Answer(ref=q.ref, job=q.job,
                                  result=self._result(q.job, Status.REJECTED, reason, entry.position, detail=detail),
                                  account_id=entry.account_id, close=None))
        return answers

    def _claim(self, it: BatchItem) -> tuple[_Lane | None, _Queued | None]:
        """The in-flight job an item reports on, taken out of flight; (None, None) if it is not one."""
        lane = self._inflight.get(it.slot)
        if lane is not None:
            for i, q in enumerate(lane.inflight):
                if q.job is it.job or q.job.job_id == it.job.job_id:
                    if q.in_flight != (it.offset, it.n_tokens):
                        break
                    q.in_flight = None
                    del lane.inflight[i]
                    return lane, q
        self.stats.stale_items += 1
        return None, None

    def _settle(self, touched: Mapping[int, _Lane]) -> None:
        for slot, lane in touched.items():
            if lane.inflight:
                continue
            if self._inflight.get(slot) is lane:
                del self._inflight[slot]
            if lane.closed is not None:
                if self.table.session_at(slot) is None and not self.table.is_dirty(slot) \
                        and not self.table.is_free(slot):
                    self.table.release_slot(slot)
            else:
                self._refresh(lane)

    def _closed_answer(self, lane: _Lane, q: _Queued, position: int, batch_size: int) -> Answer:
        """The answer for a job of a session that was closed while its call ran."""
        q.answered = True
        entry = lane.entry
        if lane.closed == "cancelled":
            self.stats.jobs_cancelled += 1
            result = self._result(q.job, Status.CANCELLED, Reason.CANCELLED, position,
                                  detail="session cancelled while the step ran",
                                  accounting=self._job_accounting(q, generated=0), batch_size=batch_size)
        elif lane.closed == "finished":
            self.stats.rejected += 1
            result = self._result(q.job, Status.REJECTED, Reason.FINISHED, position,
                                  detail="session finished before this step", batch_size=batch_size)
        else:
            self.stats.jobs_failed += 1
            result = self._result(q.job, Status.FAILED, Reason.ENGINE_ERROR, position,
                                  detail="session closed: an engine call failed on it", batch_size=batch_size)
        return Answer(ref=q.ref, job=q.job, result=result, account_id=entry.account_id, close=None)

    def _failed(self, lane: _Lane, q: _Queued, detail: str, batch_size: int) -> Answer:
        q.answered = True
        self.stats.jobs_failed += 1
        result = self._result(q.job, Status.FAILED, Reason.ENGINE_ERROR, lane.entry.position,
                              detail=detail, batch_size=batch_size)
        return Answer(ref=q.ref, job=q.job, result=result, account_id=lane.entry.account_id, close=None)
