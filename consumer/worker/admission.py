"""The worker's side of reading: which entries to read, and admitting each one (the scheduler decides,
the delivery ledger holds twins and re-sends, a hop checks activations). Every entry, whatever its
bytes, is admitted inside a guard: an exception dead-letters that entry and nothing else.

A worker of several engines (consumer/worker/lane.py) reads every lane's streams in one read and admits
each entry in one lane: the lane holding the entry's session, else the lane whose stream it came on.
Answers are kept per lane (`answers[lane.index]`): each lane's ledger files its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from schemas import Phase, Reason, Status, StepJob

from ..config import WorkerSettings
from ..sampler import RowStatus
from ..sched import Answer, Scheduler, SessionEntry
from ..transport.protocol import DeadLetter, Delivery, Inbound, Transport
from .delivery import wire_reject_outcome
from .early import EarlySteps
from .idle import IdleSessions
from .lane import Lane, Lanes, Want, read_lanes
from .stats import LoopStats

__all__ = ["Admitted", "EntryAdmission", "Prefetched"]

log = logging.getLogger("dgr.worker")


@dataclass(frozen=True, slots=True)
class Prefetched:
    """A read the I/O thread made while the engine computed: entries, cancellations, activation blobs."""

    inbound: list[Inbound]
    cancels: list[str]
    refused: list[DeadLetter]  # cancel entries that are not cancellations
    fetched: dict[str, bytes | None]
    seconds: float
    asked: Want  # the entries the read asked for, per lane and phase (what it got fewer of was drained)


@dataclass
class Admitted:
    """What admitting entries decided besides queueing steps: per lane the steps answered at once (refused,
    superseded attempts), the entries dead-lettered, those refused at the wire (answered on their session's
    stream), the twins acked without an answer; and how many entries were read, in how long."""

    answers: list[list[Answer]]
    dead: list[DeadLetter] = field(default_factory=list)
    wire_rejects: list[Answer] = field(default_factory=list)
    acks: list[Delivery] = field(default_factory=list)
    entries: int = 0
    read_s: float = 0.0

    @classmethod
    def empty(cls, lanes: int) -> Admitted:
        return cls([[] for _ in range(lanes)])

    def extend(self, other: Admitted) -> None:
        for mine, theirs in zip(self.answers, other.answers, strict=True):
            mine.extend(theirs)
        self.dead += other.dead
        self.wire_rejects += other.wire_rejects
        self.acks += other.acks
        self.entries += other.entries
        self.read_s += other.read_s


class EntryAdmission:
    """Reads and admits entries for the worker's lanes. `computing`: whether a fused call is in flight (a
    read never blocks for new entries while one computes); `wait_engine`: wait until that call has ended on
    the engine thread (it stays to be finished by the loop), before admission touches an engine."""

    def __init__(self, lanes: Lanes, transport: Transport, settings: WorkerSettings, stats: LoopStats,
                 idle: IdleSessions | None, computing: Callable[[], bool], wait_engine: Callable[[], None]) -> None:
        self.lanes, self.transport, self.settings, self.stats = lanes, transport, settings, stats
        self.idle, self.computing, self.wait_engine = idle, computing, wait_engine
        # Continuation jobs read before their session's prompt (early.py): a few per slot, for a while.
        self.early = EarlySteps(capacity=4 * lanes.slots(), hold_s=settings.early_hold_s,
                                max_hold_s=settings.early_hold_max_s)
        self.clock = time.monotonic  # the holds' clock (a test drives its own)
        # Per lane: when a read last got fewer prefill entries than it asked for (the prompt streams held no
        # more): a continuation held since before then has no opening left unread (_prompt_coming).
        self._drained: dict[int, float] = {}

    # ---- what to read ---------------------------------------------------------------------------
    def should_read(self) -> bool:
        """Read now, in the loop (blocking a little), besides what the I/O thread prefetched: when there
        is nothing to run, or steps of sessions the last call answered are on their way."""
        lanes = self.lanes
        return (not any(lane.scheduler.has_work() for lane in lanes)
                or any(lane.hot and lane.scheduler.awaiting_decode() for lane in lanes))

    def want(self) -> Want:
        """Entries to read per lane and phase: what each scheduler wants, and more prefill entries after a
        read whose prefill entries were refused (junk is read past, not one `want` at a time)."""
        want: Want = {}
        for lane in self.lanes:
            i = lane.index
            for p, n in lane.scheduler.want().items():
                if n > 0:
                    want[(i, p)] = n
            if lane.more_prefill:
                want[(i, "prefill")] = max(want.get((i, "prefill"), 0), lane.more_prefill)
        return want

    # ---- reading in the loop --------------------------------------------------------------------
    def read_and_admit(self) -> Admitted:
        """Read what the scheduler wants and admit it; while entries read are refused (and the phases
        they came from gave all that was asked), read past them at once, doubling each read, until the
        entries wanted are queued or max_read_entries were read."""
        out = Admitted.empty(len(self.lanes))
        self._admit_expired(out)
        got, want, read_s = self._read()
        queued: Want = dict.fromkeys(want, 0)
        asked = dict(want)
        total = 0
        first: Want | None = None  # what the first read took, of what was wanted
        while got:
            total += len(got)
            took, refused = self._admit_counted(got, None, out, queued)
            first = took if first is None else first
            more: Want = {}
            room = self.settings.max_read_entries - total
            for k, n in asked.items():
                if room <= 0:
                    break
                if refused.get(k) and took.get(k, 0) >= n and queued.get(k, 0) < want.get(k, 0):
                    more[k] = min(2 * n, room)
                    room -= more[k]
            if not more:
                break
            asked = more
            t = time.perf_counter()
            got = read_lanes(self.transport, self.lanes.streams, more, block_ms=0, gather_ms=0)
            self.stats.reads += 1
            read_s += time.perf_counter() - t
        self._note_drained(want, first or {})
        out.entries, out.read_s = total, read_s
        return out

    def _note_drained(self, asked: Want, took: Want) -> None:
        """A read that took fewer prefill entries than it asked for found its lane's prompt streams drained."""
        now = self.clock()
        for (i, phase), n in asked.items():
            if phase == "prefill" and took.get((i, phase), 0) < n:
                self._drained[i] = now

    def _read(self) -> tuple[list[Inbound], Want, float]:
        counts = self.want()
        if not counts:
            return [], counts, 0.0
        # Wait only for the sessions the last fused call just answered with a token: their next step is
        # on its way. Sessions that went quiet (a paused Tracker, 10,000 idle ones) cost no waiting.
        expected = sum(min(len(lane.hot), lane.scheduler.awaiting_decode()) for lane in self.lanes)
        busy = self.computing()  # a call computing is work: never block for new entries while it runs
        for lane in self.lanes:
            lane.hot = set()
            busy = busy or lane.scheduler.has_work()
        seen = [0]

        def more(got: Mapping[Phase, int]) -> bool:
            # A blocked read returns on the first entry. Keep gathering while sessions the last call
            # answered have not sent their next step yet; with none expected, while entries are still
            # arriving (a Tracker opening sessions in one burst). So the fused call is as full as it can be.
            if expected:
                return got.get("decode", 0) < expected
            n = sum(got.values())
            flowing, seen[0] = n > seen[0], n
            return flowing

        t = time.perf_counter()
        st = self.settings
        block_ms = max(0 if busy else st.block_ms, st.await_ms if expected else 0)
        got = read_lanes(self.transport, self.lanes.streams, counts, block_ms=block_ms, gather_ms=st.gather_ms,
                         more=more)
        self.stats.reads += 1
        return got, counts, time.perf_counter() - t

    # ---- admission ------------------------------------------------------------------------------
    def admit_all(self, inbound: Sequence[Inbound], fetched: dict[str, bytes | None] | None,
                  asked: Want | None = None) -> Admitted:
        """Admit entries read (by the I/O thread: `fetched` holds their activation blobs; None: fetch
        them now). `asked`: what the read asked for (None: a recovery's re-read, which says nothing of what the
        streams hold)."""
        out = Admitted.empty(len(self.lanes))
        self._admit_expired(out)
        took, refused = self._admit_counted(inbound, fetched, out, {}) if inbound else ({}, {})
        if asked is not None:
            self._note_drained(asked, took)
        if not inbound:
            return out
        # A prefetch whose prefill entries were all refused reads past them on the next one, doubling.
        cap = self.settings.max_read_entries
        for lane in self.lanes:
            n = took.get((lane.index, "prefill"), 0)
            lane.more_prefill = min(2 * n, cap) if n and refused.get((lane.index, "prefill")) == n else 0
        out.entries = len(inbound)
        return out

    def _admit_counted(self, got: Sequence[Inbound], fetched: dict[str, bytes | None] | None, out: Admitted,
                       queued: Want) -> tuple[Want, Want]:
        if fetched is None:
            fetched = self.lanes.fetch_blobs(self.transport, got)
        lanes = self.lanes
        single = len(lanes) == 1
        if single:
            steps, sids = lanes[0].ledger.steps_to_check(got)
        else:
            steps, sids = [], []
            by_lane: dict[int, list[Inbound]] = {}
            for inb in got:
                by_lane.setdefault(lanes.for_entry(inb).index, []).append(inb)
            for i, entries in by_lane.items():
                o, s = lanes[i].ledger.steps_to_check(entries)
                steps += o
                sids += s
        precheck = self.transport.checks(steps, sids) if sids else (set(), set())
        for lane in lanes:
            lane.hops.use_fetched(fetched)
            lane.ledger.precheck = precheck
        took: Want = {}
        refused: Want = {}
        for inb in got:
            # counted by the stream it was read from
            k = (0 if single else lanes.stream_lane(inb.digest).index, inb.phase)
            took[k] = took.get(k, 0) + 1
            if self.admit(inb, out):
                queued[k] = queued.get(k, 0) + 1
            else:
                refused[k] = refused.get(k, 0) + 1
        self.stats.refused += sum(refused.values())
        return took, refused

    def admit(self, inb: Inbound, out: Admitted, *, may_hold: bool = True) -> bool:
        """Queue the entry's step (True), hold it for its session's prompt (True: early.py), or answer /
        dead-letter it (False). Never raises: this is the per-entry guard, so no entry, whatever its bytes,
        can take the worker down or crash it again on every redelivery (the transport's decoding is guarded
        the same way). A session's last prompt chunk queued, the continuation jobs held for it follow."""
        job = inb.job
        if inb.ref.given_up and job is not None:
            return self._given_up(inb, job, out)
        if len(self.early) and job is not None and job.session is not None:  # an opening: older attempts first
            for stale in self.early.release_older(job.session_id, job.attempt):
                self.admit(stale, out, may_hold=False)
        try:
            lane = self.lanes.for_entry(inb)
            queued = self._admit_entry(lane, inb, out.answers[lane.index], out.dead, out.wire_rejects, out.acks,
                                       may_hold)
        except Exception as e:
            log.warning("entry refused by the per-entry guard", exc_info=True, extra={"entry": inb.name})
            out.dead.append(DeadLetter(inb.ref, Reason.MALFORMED, f"unexpected {type(e).__name__}: {e}"[:200]))
            return False
        # Its prompt queued whole, or its opening answered at once (refused, cancelled): what was held for it follows.
        # Not an opening delivered again (a re-push after an outage, `open()` twice) of the attempt open here: that
        # one is answered as a duplicate, and the prompt's later chunks are still on their way.
        if (len(self.early) and job is not None and job.phase == "prefill"
                and ((queued and job.sample) or (not queued and job.session is not None
                                                 and not self._open_at(inb, job)))):
            for held in self.early.release(job.session_id, job.attempt):
                self.admit(held, out, may_hold=False)
        return queued

    def _open_at(self, inb: Inbound, job: StepJob) -> bool:
        """Whether the job's session is open here at the job's attempt."""
        sched = self.lanes.for_entry(inb).scheduler
        return sched.table.get(job.session_id) is not None and sched.attempt(job.session_id) == job.attempt

    def _given_up(self, inb: Inbound, job: StepJob, out: Admitted) -> bool:
        """An entry the transport gave up on (delivered more than max_deliveries times), already dead-lettered
        and acked: a delivery of a job the ledger knows (answered, held here, cancelled) is handled as such;
        otherwise its session is answered STATE_LOST, so its Tracker replays it on a new attempt, never left
        waiting for an answer. Most such entries are innocent: a worker killed again and again before it made
        progress delivers every step it held once more each time. A true poison pill is bounded by the
        Tracker's max_attempts (each attempt dead-letters once). Never raises (the per-entry guard)."""
        out.dead.append(DeadLetter(inb.ref, Reason.TOO_MANY_DELIVERIES, inb.ref.given_up))  # filed: counted only
        try:
            lane = self.lanes.for_entry(inb)
            # A twin of a job answered already (the Tracker re-pushes what it did not read after an outage), held
            # here, or of a cancelled session: as any delivery of it, never a second answer under its id.
            if lane.ledger.duplicate(job, inb, out.wire_rejects, out.acks):
                return False
            out.answers[lane.index].append(lane.scheduler.refuse(
                job, inb.ref, Reason.TOO_MANY_DELIVERIES, f"given up: {inb.ref.given_up}", Status.STATE_LOST))
        except Exception:
            log.warning("an entry given up on was not answered", exc_info=True, extra={"entry": inb.name})
        return False

    def _admit_expired(self, out: Admitted) -> None:
        """Continuation jobs held past early_hold_s: admitted as they are (their sessions never came)."""
        for inb in self.early.expired(self.clock(), self._prompt_coming):
            self.stats.early_expired += 1
            self.admit(inb, out, may_hold=False)

    def _prompt_coming(self, inb: Inbound, since: float) -> bool:
        coming = self._why_coming(inb, since)
        if coming and inb.job is not None and self.early.first_overdue(inb.job.job_id):
            # Once per job: a hold past early_hold_s is rare (a wave of long prompts) and worth seeing.
            log.info("continuation held past early_hold_s for its prompt", extra={
                "session": inb.job.session_id, "job": inb.job.job_id, "why": coming,
                "held_s": round(self.clock() - since, 3)})
        return bool(coming)

    def _why_coming(self, inb: Inbound, since: float) -> str:
        """Whether a held continuation's prompt may still be unread rather than lost (early.py `expired`): no
        read of its lane since it was held found the prompt streams drained (the reader takes prompt entries a
        few at a time, none while two calls' worth of tokens are queued: its opening may wait behind a wave of
        long prompts; the Tracker pushes the opening with it, so a later read that got fewer than it asked for
        would have taken it), or its session is open here at its attempt with its prompt queued short of it."""
        job = inb.job
        if job is None:
            return ""
        lane = self.lanes.for_entry(inb)
        if self._drained.get(lane.index, float("-inf")) <= since:
            return "no read since found the prompt streams drained"
        sched = lane.scheduler
        held = sched.table.get(job.session_id)
        if held is not None and sched.attempt(job.session_id) == job.attempt and \
                held.queued_position < job.start_position:
            return f"its session is open with its prompt queued to {held.queued_position} of {job.start_position}"
        return ""

    def _admit_entry(self, lane: Lane, inb: Inbound, answers: list[Answer], dead: list[DeadLetter],
                     wire_rejects: list[Answer], acks: list[Delivery], may_hold: bool = True) -> bool:
        sched = lane.scheduler
        job = inb.job
        if job is None:
            refusal = inb.refusal
            assert refusal is not None  # an Inbound carries a job or a refusal
            dead.append(DeadLetter(inb.ref, refusal.reason, refusal.detail))
            # Tell the session too (never on a bad signature: the session was named by a forger), so its
            # caller is not left waiting. It names no billing account: it charges nothing.
            if refusal.session_id is not None:
                entry = sched.table.get(refusal.session_id)
                outcome = wire_reject_outcome(inb, entry.queued_position if entry is not None else 0)
                wire_rejects.append(Answer(ref=inb.ref, job=None, result=outcome, account_id=None, close=None,
                                           reply=refusal.reply_to or refusal.session_id))
            return False
        held = sched.table.get(job.session_id)
        if (may_hold and job.with_opening and _before_its_prompt(sched, job, held)
                and not lane.ledger.remembered(job) and self.early.hold(job.session_id, inb, self.clock())):
            # A continuation ahead of its session's prompt: admitted behind it (early.py), after the opening's
            # own checks (a cancel marker answers the opening first, with its account, then this one).
            self.stats.early_held += 1
            return True
        if lane.ledger.duplicate(job, inb, wire_rejects, acks):
            return False
        answer = lane.hops.admit(job, inb.digest, sched.engine_digests.get(job.phase),
                                 held.queued_position if held is not None else job.start_position,
                                 self.settings.worker_id, inb.ref)
        if answer is not None:
            answers.append(answer)
            return False
        if job.attempt > 0 and job.start_position == 0:  # a newer attempt re-opens (a route's replay)
            answers.extend(sched.supersede(job, inb.digest))
            # The dropped attempt's slot is cleared now, so the new attempt can take it: a full worker re-opens
            # every session of a replayed route. A call computing meanwhile (overlap on) is waited for first:
            # a release during it would be a second thread in the engine (llama.cpp's context is not safe so).
            if sched.table.n_dirty:
                self.wait_engine()
                lane.release_slots()
        if job.session is not None and job.session.sampling.constrained and not lane.hops.produces_hidden:
            grammar_refusal = self._grammar_refusal(lane, job, inb)
            if grammar_refusal is not None:
                answers.append(grammar_refusal)
                return False
        answer = sched.admit(job, inb.digest, inb.ref)
        if answer is not None:
            answers.append(answer)
            return False
        lane.ledger.admitted(job)
        if self.idle is not None:
            self.idle.touch(job.session_id)
        return True

    def _grammar_refusal(self, lane: Lane, job: StepJob, inb: Inbound) -> Answer | None:
        """An opening whose grammar this lane's sampler cannot run is refused before it takes a slot
        (an engine without a llama.cpp vocabulary, a grammar or JSON schema that does not compile)."""
        assert job.session is not None
        status = lane.sampler.check(job.session.sampling)
        if status == RowStatus.OK:
            return None
        if status == RowStatus.GRAMMAR_UNSUPPORTED:
            return lane.scheduler.refuse(job, inb.ref, Reason.GRAMMAR_UNSUPPORTED,
                                         "this worker's engine has no llama.cpp vocabulary: no grammars")
        return lane.scheduler.refuse(job, inb.ref, Reason.GRAMMAR_INVALID,
                                     "the session's grammar (or JSON schema) does not compile")


def _before_its_prompt(sched: Scheduler, job: StepJob, held: SessionEntry | None) -> bool:
    """Whether a continuation pushed with its opening (early.py) is read before that opening's prompt is queued:
    the session is not held here at the job's attempt (not open, or open at an older attempt: a replay's new
    opening has not come yet; remembered closed at an older attempt), or its prompt is not queued up to the job."""
    attempt = sched.attempt(job.session_id)
    if held is not None:
        return (attempt is not None and attempt < job.attempt) or held.queued_position < job.start_position
    return sched.table.closed(job.session_id) is None or (attempt is not None and attempt < job.attempt)
