"""Job admission: every check a step passes before it is queued, each with its own reason code and no
effect on any other session; a newer attempt's opening; cancellation."""

from __future__ import annotations

from typing import NamedTuple

from msgspec.structs import replace

from schemas import Reason, Status, StepJob
from schemas.limits import MAX_TOKENS_PER_JOB

from .outputs import Answer
from .session_table import ClosedSession, SessionEntry
from .state import SchedulerState, SessionQueue, _Queued

__all__ = ["JobAdmission", "Refused"]


class Refused(NamedTuple):
    """Why admission answers a step at once: its reason, detail, status, and whether the session's account
    is named (a refusal that could be anyone's writing names none: `already_open`)."""

    reason: Reason
    detail: str
    status: Status = Status.REJECTED
    charged: bool = True


class JobAdmission(SchedulerState):
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
        account: str | None
        if entry is not None:
            next_pos, account = entry.queued_position, entry.account_id
        elif closed is not None:
            next_pos, account = closed.position, closed.account_id
        else:
            next_pos, account = job.start_position, None
        refused = (self._route_refusal(job, stream_digest, entry, closed)
                   or self._order_refusal(job, entry, closed, next_pos) or self._content_refusal(job, closed))
        if refused is None and entry is None:
            entry, refused = self._open(job)
        if refused is not None:
            return self._reject(job, ref, refused.reason, next_pos, account if refused.charged else None,
                                refused.detail, status=refused.status)
        assert entry is not None
        lane = self._lanes[sid]
        self._seq += 1
        lane.jobs.append(_Queued(job=job, ref=ref, seq=self._seq))
        entry.queued_position = job.end_position
        entry.queued_samples = job.sample
        self._queues[job.phase].add(job)
        self.stats.admitted += 1
        self._refresh(lane)
        return None

    def _route_refusal(self, job: StepJob, stream_digest: str, entry: SessionEntry | None,
                       closed: ClosedSession | None) -> Refused | None:
        """Check 1: the job's key, stream and engine agree; its hop is this worker's."""
        engine_digest = self.engine_digests.get(job.phase)
        if engine_digest is None or not (job.compat == stream_digest == engine_digest):
            return Refused(Reason.INCOMPATIBLE, f"job compat {job.compat}, stream {stream_digest}, engine "
                                                f"{job.phase} {engine_digest}")
        spec = entry.spec if entry is not None else job.session if closed is None else None
        route = spec.route if spec is not None else None
        if route is not None and (job.hop >= len(route) or route[job.hop].worker_id != self.worker_id):
            return Refused(Reason.WRONG_HOP, f"hop {job.hop} is not this worker's on the session's route")
        if route is not None and len(route) > 1 and job.n > 1:
            # Refused, not clamped: each token of a route of several hops travels back to hop 0 first.
            return Refused(Reason.WRONG_HOP, "a continuation (n > 1) needs a route of one hop")
        return None

    def _order_refusal(self, job: StepJob, entry: SessionEntry | None, closed: ClosedSession | None,
                       next_pos: int) -> Refused | None:
        """Check 2 (and a cancel's finality): the job's attempt and position against the session's."""
        held_attempt = self._attempts.get(job.session_id) if entry is not None else None
        if held_attempt is not None and job.attempt < held_attempt:
            # A step of an attempt this worker dropped for a newer one (a route replay): never computed.
            return Refused(Reason.DUPLICATE, f"attempt {job.attempt} is older than the session's attempt "
                                             f"{held_attempt}")
        if held_attempt is not None and job.attempt > held_attempt and not (job.phase == "prefill"
                                                                          and job.start_position == 0):
            # A step of an attempt whose opening this worker has not seen (a replay's first continuation
            # read before its prompt and held past early_hold_s, or a forger's): not a step of the attempt
            # held here, whatever its position; the Tracker replays the attempt it named.
            return Refused(Reason.UNKNOWN_SESSION, f"this worker holds attempt {held_attempt} of the session, "
                                                   f"not {job.attempt}", Status.STATE_LOST)
        if closed is not None and closed.kind == "cancelled" and job.job_id != closed.opening_job_id:
            # A cancel is final whatever the step's position: a later prompt chunk or a replay's new
            # attempt of a cancelled session is answered CANCELLED, never POSITION_GAP or a fresh open.
            return Refused(Reason.CANCELLED, "session was cancelled", Status.CANCELLED)
        known = entry if entry is not None else closed
        if known is not None:
            if job.phase == "prefill" and job.start_position == 0:
                if job.job_id == known.opening_job_id:
                    return Refused(Reason.DUPLICATE, "the opening prefill was already received")
                if entry is not None:  # another opening naming an open session: charged to nobody
                    return Refused(Reason.ALREADY_OPEN, "session is already open", charged=False)
            elif job.start_position < next_pos:
                return Refused(Reason.DUPLICATE, f"position {job.start_position} < next position {next_pos}")
            elif job.start_position > next_pos:
                return Refused(Reason.POSITION_GAP, f"position {job.start_position} > next position {next_pos}")
        if entry is not None and not job.tokens and not entry.queued_samples:
            # A job with no token feeds the token sampled at its position: none is sampled there.
            return Refused(Reason.POSITION_GAP, f"no token is sampled at position {job.start_position} to "
                                                "continue from")
        return None

    def _content_refusal(self, job: StepJob, closed: ClosedSession | None) -> Refused | None:
        """Checks 3-5: the tokens and length the engine can take; a session that ended."""
        cap = self.config.capacity
        top = max(job.tokens, default=0)
        if top >= cap.vocab_size:
            return Refused(Reason.BAD_TOKEN, f"token {top} >= vocab_size {cap.vocab_size}")
        if job.end_position > cap.ctx_per_session or len(job.tokens) > MAX_TOKENS_PER_JOB:
            return Refused(Reason.TOO_LONG, f"end position {job.end_position} > ctx_per_session "
                                            f"{cap.ctx_per_session}" if job.end_position > cap.ctx_per_session
                           else f"{len(job.tokens)} tokens > {MAX_TOKENS_PER_JOB}")
        if closed is not None:
            if closed.kind == "cancelled":
                return Refused(Reason.CANCELLED, "session was cancelled", Status.CANCELLED)
            return Refused(Reason.FINISHED, "session has finished")
        return None

    def _open(self, job: StepJob) -> tuple[SessionEntry | None, Refused | None]:
        """Check 6: a prefill at 0 opens the session on a free slot, within its account's limit."""
        if not (job.phase == "prefill" and job.start_position == 0):
            return None, Refused(Reason.UNKNOWN_SESSION, "this worker does not hold the session", Status.STATE_LOST)
        assert job.session is not None  # StepJob guarantees it on the opening prefill
        limit = self.config.max_slots_per_account
        if limit and self.table.account_sessions(job.session.account_id) >= limit:
            return None, Refused(Reason.ACCOUNT_LIMIT,
                                 f"account {job.session.account_id} holds {limit} sessions on this worker")
        entry = self.table.open(job.session, job.job_id)
        if entry is None:
            return None, Refused(Reason.CAPACITY, f"all {self.config.capacity.n_slots} slots are taken")
        sid = job.session_id
        self.stats.sessions_opened += 1
        self._lanes[sid] = SessionQueue(entry=entry)
        self._attempts[sid] = job.attempt
        self._attempts.move_to_end(sid)
        while len(self._attempts) > self.config.closed_capacity + self.config.capacity.n_slots:
            self._attempts.popitem(last=False)
        return entry, None

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
        self._drop_restore(lane)  # prefix cache: its pinned entry let go
        self.table.close(sid, "failed")  # forgotten outright (no closed record), the slot released
        del self._lanes[sid]
        del self._attempts[sid]
        lane.closed = "failed"
        return answers

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
                                    q=q),
                account_id=entry.account_id, close=None))
        self._close(lane, "cancelled")
        if answers:
            answers[-1] = replace(answers[-1], close="cancelled")
        return answers

    def refuse(self, job: StepJob, ref: object, reason: Reason, detail: str,
               status: Status = Status.REJECTED) -> Answer:
        """Answer a step REJECTED (or `status`) for a reason found outside the scheduler (the worker's sampler
        cannot serve the session's grammar; the transport gave up on the entry): nothing is queued nor opened.
        A session this scheduler holds is charged to its account; an opening names its own."""
        held = self.table.get(job.session_id)
        account = held.account_id if held is not None else (job.session.account_id if job.session else None)
        position = held.queued_position if held is not None else job.start_position
        return self._reject(job, ref, reason, position, account, detail, status)

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
