"""The batching worker loop: read -> admit -> cancellations -> one fused engine call -> complete.

It joins three parts that know nothing of each other: the transport (all Redis I/O), the scheduler
(pure decisions) and the engine (one forward pass per call). Nothing here speaks Redis.

Delivery (issue 12): every step gets exactly one real answer. A job id delivered again while the
worker still holds it (queued or in a call: a producer retry, `open()` twice, a re-push after an
outage) is held as a *twin* and completed with the original's answer; one delivered again after it
was answered gets the same completion re-sent (a no-op unless Redis lost the first one). A step of a
session this worker does not hold is checked first against Redis (one round trip per read that has
any): an opening already answered (by an earlier process) -> acked, no ghost session; a cancel
marker -> answered CANCELLED without taking a slot (not state_lost: a cancelled session is not
replayed).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import FrameType

from schemas import PHASES, Phase, Reason, Status, StepJob, StepResult, WorkerKeys
from schemas.limits import MAX_CONTINUATION
from schemas.step import end_job_id, result_job_id

from .config import WorkerSettings
from .continuation import acking, without_ack
from .engines.base import Engine, EngineError, engine_key
from .hop_steps import HopSteps
from .idle import IdleSessions
from .metrics import Metrics
from .pacing import PrefillPacer
from .sampler import BatchSampler
from .scheduler import Answer, ScheduledBatch, Scheduler, SchedulerConfig
from .transport import LeaseLost
from .transport_protocol import DeadLetter, Delivery, FusedCallStats, Inbound, Refusal, Transport

log = logging.getLogger("dgr.worker")




@dataclass
class LoopStats:
    """Plain counters the benchmarks read (the Prometheus metrics carry the same, labelled)."""

    fused_calls: int = 0
    sessions_in_calls: int = 0
    calls_by_phase: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    engine_seconds: float = 0.0
    overhead_seconds: float = 0.0  # loop time outside the engine and outside reads, on iterations with a call
    read_seconds: float = 0.0  # time in transport.read (blocking, gathering: mostly waiting for producers)
    round_trips: int = 0
    decode_sessions: int = 0  # sessions summed over decode calls (mean decode batch = this / decode calls)
    reads: int = 0  # transport.read calls (a burst read past in one iteration counts each read)
    refused: int = 0  # entries answered or dead-lettered at admission without being queued
    sessions_idle_cancelled: int = 0
    recent_calls: deque[tuple[Phase, int]] = field(default_factory=lambda: deque(maxlen=4096))  # (phase, sessions)

    def snapshot(self) -> dict[str, object]:
        return {"fused_calls": self.fused_calls, "sessions_in_calls": self.sessions_in_calls,
                "calls_by_phase": dict(self.calls_by_phase), "engine_seconds": self.engine_seconds,
                "overhead_seconds": self.overhead_seconds, "read_seconds": self.read_seconds,
                "round_trips": self.round_trips,
                "decode_sessions": self.decode_sessions, "reads": self.reads, "refused": self.refused,
                "sessions_idle_cancelled": self.sessions_idle_cancelled}

    @property
    def mean_batch(self) -> float:
        return self.sessions_in_calls / self.fused_calls if self.fused_calls else 0.0


class Worker:
    def __init__(self, engine: Engine, transport: Transport, settings: WorkerSettings,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.transport = transport
        self.settings = settings
        self.metrics = metrics or Metrics(settings.worker_id)
        self.keys = {p: engine_key(engine, p) for p in PHASES}
        cap = engine.capacity
        self.scheduler = Scheduler(
            SchedulerConfig(capacity=cap, max_batch=min(settings.max_batch, cap.n_slots),
                            prefill_budget=min(settings.prefill_budget, cap.max_tokens_per_call),
                            w_decode=settings.w_decode, w_prefill=settings.w_prefill,
                            max_slots_per_account=settings.max_slots_per_account),
            settings.worker_id, {p: k.digest for p, k in self.keys.items()})
        self.sampler = BatchSampler(cap.vocab_size)
        self.hops = HopSteps(engine.boundary, WorkerKeys(settings.worker_id))  # route hops: activations in/out
        self.pacer = PrefillPacer(max_tokens=self.scheduler.config.prefill_budget, ratio=settings.prefill_ratio,
                                  min_tokens=settings.prefill_floor)
        self._registered = False
        self.idle = IdleSessions(settings.idle_session_s, clock) if settings.idle_session_s > 0 else None
        self._hot: set[str] = set()  # sessions that got a token in the last fused call, not finished
        self.stats = LoopStats()
        self._stop = threading.Event()
        self._last_heartbeat = 0.0
        self._last_recover = 0.0
        self._started = time.time()
        self._m = settings.worker_id
        # job id -> (session id, position) of the job admitted under it, while queued or in a call
        self._held: dict[str, tuple[str, int]] = {}
        # job id -> more deliveries of it while held (with their created_at, for the latency metric)
        self._twins: dict[str, list[tuple[Delivery, float]]] = {}
        self._answered: OrderedDict[str, Answer] = OrderedDict()  # job id -> its answer, ref dropped (LRU)
        self._precheck: tuple[set[str], set[str]] = (set(), set())  # (answered job ids, cancelled sessions)
        self._outages_seen = 0
        # Overlap (issue 15): the completion of fused call k (one Lua publish) runs on this single
        # thread while the loop reads, admits and runs call k+1; one thread, so results stay in order.
        self._publisher: ThreadPoolExecutor | None = None
        self._publishing: Future[None] | None = None
        self._last_call_s = 0.0  # the engine time of the last fused call (the overlap's length rule)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        # One live consumer per worker id: wait as a standby (or refuse) while another holds the lease.
        self.transport.acquire_lease(wait=self.settings.standby)
        # A fresh scheduler believes every slot is free: make the engine agree, whatever it held before.
        for slot in range(self.engine.capacity.n_slots):
            self.engine.release(slot)
        names = self.transport.register(list(self.keys.values()), self._info())
        self._registered = True
        log.info("worker ready", extra={"worker": self._m, "streams": names, "engine": self.engine.describe()})
        self._last_recover = time.monotonic()
        self._outages_seen = self.transport.outages
        self._recover()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("stop requested", extra={"signal": signum})
            self.request_stop()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self, max_idle_s: float | None = None) -> None:
        """Serve until stopped. The in-flight fused call always completes; unread entries stay queued."""
        if not self._registered:
            self.start()
        idle_since = time.monotonic()
        try:
            try:
                while not self._stop.is_set():
                    if self.run_once(flush=not self._overlapping()):
                        idle_since = time.monotonic()
                    elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                        self.flush()
                        break
            except BaseException:
                self._drain_quietly()  # the in-flight publish finishes (or fails) before the error goes on
                raise
            self.flush()  # the last call's results are out before the last heartbeat
        except LeaseLost:
            # Another process serves this worker id now: write nothing more (no heartbeat, no release).
            log.error("lease lost to another consumer: stopping without writing", extra={"worker": self._m})
            raise
        self.transport.heartbeat({**self._info(), "stopped": True})  # the last word: what it held at exit
        self.transport.release_lease()
        log.info("worker stopped", extra={"worker": self._m, "fused_calls": self.stats.fused_calls})
        self._close_publisher()

    # ---- overlapped completion -----------------------------------------------------------------
    def _overlapping(self) -> bool:
        """Publish on the helper thread this iteration? (settings.overlap, while fused calls are short)"""
        limit = self.settings.overlap_max_call_ms
        return self.settings.overlap and (limit <= 0 or 1e3 * self._last_call_s <= limit)

    def flush(self) -> None:
        """Wait for the in-flight completion (if any); its error (LeaseLost, a Redis outage given up
        on) is raised here, in the loop's thread."""
        pending, self._publishing = self._publishing, None
        if pending is not None:
            pending.result()

    def _drain_quietly(self) -> None:
        try:
            self.flush()
        except Exception:
            log.warning("in-flight completion failed while the loop was stopping on another error", exc_info=True)

    def _close_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None

    def _publish(self, completions: Sequence[Answer], dead: Sequence[DeadLetter], call: FusedCallStats | None,
                 closing: Sequence[tuple[str, str]], flush: bool) -> None:
        """transport.complete, then the closures no answer carried: at once (flush), or on the publisher
        thread after the previous publish (the loop goes on to the next call meanwhile)."""
        def work() -> None:
            if completions or dead or call:
                self.transport.complete(completions, dead, call)
            if closing:
                self.transport.close_sessions(closing)

        self.flush()  # call k-1's results before call k's: a session's results stay in order
        if not (completions or dead or call or closing):
            return
        if flush:
            work()
            return
        if self._publisher is None:
            self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dgr-publish-{self._m}")
        self._publishing = self._publisher.submit(work)

    # ---- one iteration ---------------------------------------------------------------------
    def run_once(self, *, flush: bool = True) -> bool:
        """One iteration. flush=False (the loop, with `overlap` on): this call's completion may still be
        in flight on return; the next iteration (or `flush()`) waits for it before publishing again."""
        t0 = time.perf_counter()
        self._housekeeping()
        answers: list[Answer] = []
        dead: list[DeadLetter] = []
        wire_rejects: list[Answer] = []
        deliveries, read_s = self._read_and_admit(answers, dead, wire_rejects)
        self.stats.read_seconds += read_s
        cancelled = self.transport.cancellations()
        dead.extend(self.transport.drain_rejected_cancellations())
        not_held: list[str] = []
        for sid in cancelled + self._idle_sessions():
            if self.scheduler.table.get(sid) is None:
                not_held.append(sid)
            self._cancel(sid, answers)
        decoding = self.scheduler.awaiting_decode() > 0 or self.scheduler.queued("decode") > 0
        self.scheduler.set_prefill_budget(self.pacer.budget(decoding))
        batch = self.scheduler.next_batch()
        engine_s = 0.0
        call: FusedCallStats | None = None
        if batch is not None:
            before = self.stats.engine_seconds
            answers.extend(self._run_batch(batch))
            engine_s = self.stats.engine_seconds - before  # the engine alone (all tries, if it failed)
            self._last_call_s = engine_s
            call = FusedCallStats(phase=batch.phase, batch_size=len(batch.session_ids), tokens=len(batch.fused),
                                  engine_seconds=engine_s)
        latencies: list[tuple[Phase, float]] = []
        completions = wire_rejects + self._completions(answers, latencies)
        self._publish(completions, dead, call, self._uncarried(completions, not_held), flush)
        self.stats.round_trips = self.transport.round_trips
        self._release_slots()
        self._observe(batch, call, completions, dead, latencies)
        if call is not None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("fused call", extra={"phase": call.phase, "sessions": call.batch_size, "rows": call.tokens,
                                               "engine_ms": round(1e3 * engine_s, 2), "read_ms": round(1e3 * read_s, 2),
                                               "loop_ms": round(1e3 * (time.perf_counter() - t0), 2)})
            # the worker's own time: the read is left out (mostly waiting for producers), see read_seconds
            overhead = time.perf_counter() - t0 - engine_s - read_s  # sampling and completion count here
            self.stats.overhead_seconds += overhead
            self.metrics.overhead.labels(self._m).observe(overhead)
        return bool(deliveries or completions or dead or batch)

    def _read_and_admit(self, answers: list[Answer], dead: list[DeadLetter],
                        wire_rejects: list[Answer]) -> tuple[int, float]:
        """Read what the scheduler wants and admit it; while entries read are refused (and the phases
        they came from gave all that was asked), read past them at once, doubling each read, until
        the entries wanted are queued or max_read_entries were read. Returns (entries, read seconds)."""
        got, want, read_s = self._read()
        self.hops.prefetch(self.transport, got)
        queued: dict[Phase, int] = dict.fromkeys(want, 0)
        asked = dict(want)
        total = 0
        while got:
            total += len(got)
            took: dict[Phase, int] = {}
            refused: dict[Phase, int] = {}
            self._precheck_openings(got)
            for inb in got:
                took[inb.phase] = took.get(inb.phase, 0) + 1
                if self._admit(inb, answers, dead, wire_rejects):
                    queued[inb.phase] = queued.get(inb.phase, 0) + 1
                else:
                    refused[inb.phase] = refused.get(inb.phase, 0) + 1
            self.stats.refused += sum(refused.values())
            more: dict[Phase, int] = {}
            room = self.settings.max_read_entries - total
            for p, n in asked.items():
                if room <= 0:
                    break
                if refused.get(p) and took.get(p, 0) >= n and queued.get(p, 0) < want.get(p, 0):
                    more[p] = min(2 * n, room)
                    room -= more[p]
            if not more:
                break
            asked = more
            t = time.perf_counter()
            got = self.transport.read(more, block_ms=0, gather_ms=0)
            self.hops.prefetch(self.transport, got)
            self.stats.reads += 1
            read_s += time.perf_counter() - t
        return total, read_s

    def _read(self) -> tuple[list[Inbound], dict[Phase, int], float]:
        counts = {p: n for p, n in self.scheduler.want().items() if n > 0}
        if not counts:
            return [], counts, 0.0
        # Wait only for the sessions the last fused call just answered with a token: their next step is
        # on its way. Sessions that went quiet (a paused Tracker, 10,000 idle ones) cost no waiting.
        expected = min(len(self._hot), self.scheduler.awaiting_decode())
        self._hot = set()
        busy = self.scheduler.has_work()

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
        block_ms = max(0 if busy else self.settings.block_ms, self.settings.await_ms if expected else 0)
        got = self.transport.read(counts, block_ms=block_ms, gather_ms=self.settings.gather_ms, more=more)
        self.stats.reads += 1
        return got, counts, time.perf_counter() - t

    def _admit(self, inb: Inbound, answers: list[Answer], dead: list[DeadLetter],
               wire_rejects: list[Answer]) -> bool:
        """Queue the entry's step (True), or answer / dead-letter it (False). Never raises: this is the
        per-entry guard, so no entry, whatever its bytes, can take the worker down or crash it again
        on every redelivery (the transport's decoding is guarded the same way)."""
        try:
            return self._admit_entry(inb, answers, dead, wire_rejects)
        except Exception as e:
            log.warning("entry refused by the per-entry guard", exc_info=True, extra={"entry": inb.name})
            dead.append(DeadLetter(inb.ref, Reason.MALFORMED, f"unexpected {type(e).__name__}: {e}"[:200]))
            return False

    def _admit_entry(self, inb: Inbound, answers: list[Answer], dead: list[DeadLetter],
                     wire_rejects: list[Answer]) -> bool:
        job = inb.job
        if job is None:
            refusal = inb.refusal
            assert refusal is not None  # an Inbound carries a job or a refusal
            dead.append(DeadLetter(inb.ref, refusal.reason, refusal.detail))
            # Tell the session too (never on a bad signature: the session was named by a forger), so its
            # caller is not left waiting.
            if refusal.session_id is not None:
                wire_rejects.append(self._wire_reject(inb, refusal))
            return False
        if self._duplicate(job, inb, wire_rejects):
            return False
        held = self.scheduler.table.get(job.session_id)
        answer = self.hops.admit(job, inb.digest, self.scheduler.engine_digests.get(job.phase),
                                 held.queued_position if held is not None else job.start_position, self._m, inb.ref)
        if answer is not None:
            answers.append(answer)
            return False
        if job.attempt > 0 and job.start_position == 0:  # a newer attempt re-opens (a route's replay)
            answers.extend(self.scheduler.supersede(job, inb.digest))
            # The dropped attempt's slot is cleared now (no engine call runs during admission), so the new
            # attempt can take it: a full worker re-opens every session of a replayed route.
            self._release_slots()
        answer = self.scheduler.admit(job, inb.digest, inb.ref)
        if answer is not None:
            answers.append(answer)
            return False
        self._held[job.job_id] = (job.session_id, job.start_position)
        if self.idle is not None:
            self.idle.touch(job.session_id)
        return True

    def _wire_reject(self, inb: Inbound, refusal: Refusal) -> Answer:
        """The answer to an undecodable entry that names its session. With no readable job id it is
        answered under the entry's name (`<phase>.<entry id>`), unique per entry. It names no billing
        account, so it charges nothing and its keys live the transport's reject ttl, not the session's."""
        assert refusal.session_id is not None
        entry = self.scheduler.table.get(refusal.session_id)
        res = StepResult(job_id=refusal.job_id or inb.name, session_id=refusal.session_id,
                         status=Status.REJECTED, reason=refusal.reason, detail=refusal.detail[:256],
                         position=entry.queued_position if entry is not None else 0, worker_id=self._m)
        return Answer(ref=inb.ref, job=None, result=res, account_id=None, close=None)

    def _cancel(self, session_id: str, answers: list[Answer]) -> None:
        try:
            answers.extend(self.scheduler.cancel(session_id))
        except Exception:  # a valid id reaching a scheduler bug must not stop the loop; say so loudly
            log.exception("cancellation failed", extra={"session": session_id})

    def _idle_sessions(self) -> list[str]:
        """Open sessions with no step admitted or served for idle_session_s: cancelled like any other."""
        if self.idle is None:
            return []
        due = self.idle.due(self.scheduler.table.__contains__, self.scheduler.session_busy)
        for sid in due:
            self.stats.sessions_idle_cancelled += 1
            log.info("idle session cancelled", extra={"session": sid, "idle_s": self.idle.idle_s})
        return due

    # ---- exactly one real answer per step ----------------------------------------------------
    def _precheck_openings(self, inbound: Sequence[Inbound]) -> None:
        """One round trip for the steps of sessions this worker does not hold (an opening, or a step
        it would answer state_lost after a restart): is the opening answered already (by an earlier
        process)? is there a cancel marker? Nothing when every step's session is held."""
        jobs: list[str] = []
        sids: list[str] = []
        for inb in inbound:
            job = inb.job
            if job is None:
                continue  # not a job: _admit answers it
            jid, sid = job.job_id, job.session_id
            if jid in self._held or jid in self._answered or self.scheduler.table.get(sid) is not None:
                continue
            if inb.phase == "prefill" and job.start_position == 0:
                jobs.append(jid)
            sids.append(sid)
        self._precheck = self.transport.checks(jobs, sids) if sids else (set(), set())

    def _duplicate(self, job: StepJob, inb: Inbound, out: list[Answer]) -> bool:
        """Handle a delivery of a job id seen before (or answered by an earlier process, or of a
        session cancelled before it opened). True when the job must not reach the scheduler."""
        jid = job.job_id
        if self._held.get(jid) == (job.session_id, job.start_position):
            # queued or in a call: complete it with the original's answer. A continuation under way also
            # re-sends the tokens it published so far (acking nothing): the producer pushes a job again
            # when Redis lost results, and a lost token must not wait for a job that never re-sends it.
            self._twins.setdefault(jid, []).append((inb.ref, job.created_at))
            if job.n > 1:
                out.extend(without_ack(replace(a, ref=inb.ref, final=False)) for a in self._remembered(job))
            return True
        done = self._remembered(job)
        if done:  # answered: re-send the same answers (no-op unless Redis lost them), the last one acks
            out.extend(without_ack(replace(a, ref=inb.ref, final=False)) for a in done[:-1])
            out.append(acking(done[-1], inb.ref))
            return True
        answered, cancelled = self._precheck
        if jid in answered:  # answered by an earlier process: the stored result stands, ack this one
            res = StepResult(job_id=jid, session_id=job.session_id, status=Status.REJECTED, reason=Reason.DUPLICATE,
                             detail="already answered", position=job.start_position, worker_id=self._m)
            # job=None: not the job's answer (the stored one is), so no replay or position rule applies
            out.append(Answer(ref=inb.ref, job=None, result=res, account_id=None, close=None))
            return True
        if job.session_id in cancelled and self.scheduler.table.get(job.session_id) is None \
                and self.scheduler.table.closed(job.session_id) is None:
            out.append(self._remember(self.scheduler.refuse_cancelled(job, inb.ref)))
            return True
        return False

    def _remembered(self, job: StepJob) -> list[Answer]:
        """The answers this worker remembers for the job, in offset order. A continuation job (n > 1) has
        one per token and maybe an ending one: a redelivery after it ended (the producer re-pushes it when
        Redis lost some of its results) re-sends them all, so every lost one is published again (found
        by tests/test_delivery.py's lost-data-set test: re-sending the first token's alone left the
        others lost and put a stale token after the newer ones)."""
        jid = job.job_id
        ids = [jid] if job.n == 1 else [*(result_job_id(jid, k) for k in range(job.n)), end_job_id(jid)]
        out: list[Answer] = []
        for rid in ids:
            a = self._answered.get(rid)
            if a is not None:
                self._answered.move_to_end(rid)
                out.append(a)
        return out

    def _completions(self, answers: Sequence[Answer], latencies: list[tuple[Phase, float]]) -> list[Answer]:
        """Every answer, plus one per twin delivery of its job (same result); the step latency of
        every OK one is added to `latencies`."""
        out: list[Answer] = []
        now = time.time()
        for a in answers:
            a = self.hops.finish(a)
            out.append(without_ack(self._remember(a)))
            job = a.job
            if job is None:
                continue
            ok = a.result.status == Status.OK
            if ok and job.created_at and a.result.job_id == job.job_id:  # a continuation's first token only
                latencies.append((job.phase, max(0.0, now - job.created_at)))
            if not a.final:  # a continuation goes on: still held, its twins acked with its last answer
                continue
            self._held.pop(job.job_id, None)
            for twin, created_at in self._twins.pop(job.job_id, ()):
                out.append(replace(a, ref=twin))
                if ok and created_at:
                    latencies.append((job.phase, max(0.0, now - created_at)))
        return out

    def _remember(self, a: Answer) -> Answer:
        # Kept without its delivery (a prompt chunk, a session spec): a re-send names its own entry.
        # (The constructor, not dataclasses.replace: this runs once per session per fused call.) Kept
        # without a hop's output rows too: the first completion wrote them, a re-send is a no-op.
        jid = a.result.job_id
        answered = self._answered
        answered[jid] = Answer(ref=None, job=a.job, result=a.result, account_id=a.account_id, close=a.close,
                               blob=None, final=a.final)
        answered.move_to_end(jid)
        while len(answered) > self.settings.answered_memory:
            answered.popitem(last=False)
        return a

    def _uncarried(self, completions: Sequence[Answer], cancelled_not_held: Sequence[str]) -> list[tuple[str, str]]:
        """The sessions whose accounting no answer closes, to close after the completion: a cancel with
        nothing queued, a failed engine call, a cancel of a session this worker does not hold (an
        earlier process may have charged it)."""
        carried = {c.result.session_id for c in completions if c.close is not None}
        todo: list[tuple[str, str]] = [(cs.session_id, cs.kind) for cs in self.scheduler.drain_closed()
                                       if cs.session_id not in carried]
        todo += [(sid, "cancelled") for sid in cancelled_not_held if sid not in carried]
        return todo

    def _run_batch(self, batch: ScheduledBatch) -> list[Answer]:
        """One fused call. On failure, answer the offending sessions `failed` and keep serving the rest:
        retry without the slots the engine named, else bisect."""
        t = time.perf_counter()
        try:
            output = self.engine.forward(self.hops.fused(batch))
        except Exception as e:  # any engine fault must not take the worker down
            self.stats.engine_seconds += time.perf_counter() - t
            self.metrics.engine_failures.labels(self._m).inc()
            detail = f"{type(e).__name__}: {e}"[:200]
            sessions = batch.session_ids
            log.warning("fused call failed", extra={"sessions": len(sessions), "error": detail})
            if len(sessions) == 1:
                return self.scheduler.fail(batch, detail)
            named = set(e.slots) if isinstance(e, EngineError) else set()
            bad = [i.job.session_id for i in batch.items if i.slot in named]
            if bad:
                good = batch.without(bad)
                only_bad = batch.without([s for s in sessions if s not in bad])
                out = self.scheduler.fail(only_bad, detail) if only_bad else []
                return out + (self._run_batch(good) if good else [])
            half = set(sessions[: len(sessions) // 2])
            first, second = batch.without([s for s in sessions if s not in half]), batch.without(half)
            return [o for part in (first, second) if part is not None for o in self._run_batch(part)]
        elapsed = time.perf_counter() - t
        self.stats.fused_calls += 1
        self.stats.sessions_in_calls += len(batch.session_ids)
        self.stats.calls_by_phase[batch.phase] += 1
        self.stats.recent_calls.append((batch.phase, len(batch.session_ids)))
        if batch.phase == "decode":
            self.stats.decode_sessions += len(batch.session_ids)
        self.stats.engine_seconds += elapsed
        self.pacer.observe(batch.phase, len(batch.fused), elapsed)
        if output.kind == "hidden":  # a hop that is not last answers activations, no sampling
            try:
                tokens: Sequence[int | None] = self.hops.collect(batch, output)
            except Exception as e:  # the engine ran (its state moved) but its rows are unusable: no retry
                log.warning("hop output refused", extra={"sessions": len(batch.session_ids), "error": str(e)})
                return self.scheduler.fail(batch, f"hop output: {e}"[:200])
        else:  # the last hop (or a whole model) samples
            tokens = self.sampler(batch, output)
        outcomes = self.scheduler.update_from_output(batch, tokens, elapsed)
        if self.idle is not None:
            for o in outcomes:
                self.idle.touch(o.result.session_id)
        # Sessions that still hold credit (a continuation goes on, or the next one is queued) send nothing,
        # and on a route of several hops the next step comes back through every hop: the read waits only
        # for one-hop sessions that are awaiting their next step.
        self._hot.update(o.result.session_id for o in outcomes if o.result.token is not None and not o.result.finished
                         and o.job is not None and o.job.hop == 0 and self.scheduler.is_awaiting(o.result.session_id))
        return outcomes

    def _release_slots(self) -> None:
        for slot in self.scheduler.drain_released():
            self.engine.release(slot)
            self.scheduler.slot_cleared(slot)

    # ---- periodic --------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if self._publishing is not None and (
                self.transport.outages != self._outages_seen or now - self._last_heartbeat >= self.settings.heartbeat_s
                or now - self._last_recover >= self.settings.recover_every_s):
            # The lease check, the heartbeat, trims and the ownership sweep see the transport with
            # nothing in flight (the sweep reads which entries are still outstanding).
            self.flush()
        if self.transport.outages != self._outages_seen:
            self._after_outage()
        if now - self._last_heartbeat >= self.settings.heartbeat_s:
            self._last_heartbeat = now
            self.transport.renew_lease()  # LeaseLost when another process took over (a long pause)
            self.transport.heartbeat(self._info())
            for stream, lag in self.transport.input_lag().items():
                self.metrics.input_lag.labels(self._m, stream).set(lag.get("lag", 0))
            self.transport.trim()
        if now - self._last_recover >= self.settings.recover_every_s:
            self._last_recover = now
            self._recover()

    def _after_outage(self) -> None:
        """Redis was unreachable and is back: it may have restarted, lost the tail of its data set or
        failed over. Re-advertise (spec, groups, scripts), check the lease, and sweep: own pending
        entries the worker does not hold (a read whose reply was lost) are handed out again. The
        engine state and the session table are untouched."""
        self._outages_seen = self.transport.outages
        log.info("re-registering after a redis outage", extra={"worker": self._m, "outages": self._outages_seen})
        self.transport.renew_lease()
        self.transport.register(list(self.keys.values()), self._info())
        self._last_recover = time.monotonic()
        self._recover()

    def _recover(self) -> None:
        self.flush()
        inbound, dead = self.transport.recover()
        self.hops.prefetch(self.transport, inbound)
        answers: list[Answer] = []
        wire_rejects: list[Answer] = []
        self._precheck_openings(inbound)
        for inb in inbound:
            self._admit(inb, answers, dead, wire_rejects)
        completions = wire_rejects + self._completions(answers, [])
        if completions or dead:
            self.transport.complete(completions, dead, None)
        for dl in dead:
            self.metrics.dead_letters.labels(self._m, dl.reason.value).inc()

    def _info(self) -> dict[str, object]:
        cap = self.engine.capacity
        return {"worker_id": self._m, "pid": os.getpid(), "started_at": self._started,
                "slots": cap.n_slots, "busy_slots": self.scheduler.table.busy_slots,
                "scheduler": self.scheduler.stats.as_dict(),
                "ctx_per_session": cap.ctx_per_session, "max_batch": self.scheduler.config.max_batch,
                "max_continuation": MAX_CONTINUATION,  # the producer asks for n > 1 only when advertised
                "prefill_budget": self.scheduler.config.prefill_budget, "prefill_max": self.pacer.max_tokens,
                "prefill_ratio": self.pacer.ratio, "vocab_size": cap.vocab_size,
                "engine": self.engine.describe(), "stats": self.stats.snapshot()}

    def _observe(self, batch: ScheduledBatch | None, call: FusedCallStats | None,
                 completions: Sequence[Answer], dead: Sequence[DeadLetter],
                 latencies: Sequence[tuple[Phase, float]]) -> None:
        m, w = self.metrics, self._m
        if batch is not None and call is not None:
            m.batch_size.labels(w, call.phase).observe(call.batch_size)
            m.tokens.labels(w, call.phase).inc(call.tokens)
            m.engine_seconds.labels(w, call.phase).inc(call.engine_seconds)
        # Counted per label set, then one labels() lookup each: this runs for every session of every call.
        outcomes: dict[tuple[str, str], int] = {}
        for c in completions:
            r = c.result
            key = (r.status.value, r.reason.value if r.reason else "")
            outcomes[key] = outcomes.get(key, 0) + 1
        for (status, reason), n in outcomes.items():
            m.results.labels(w, status, reason).inc(n)
        m.observe_answers(completions, time.time())  # TTFT and inter-token latency
        if latencies:
            by_phase: dict[Phase, list[float]] = {}
            for phase, seconds in latencies:
                by_phase.setdefault(phase, []).append(seconds)
            for phase, values in by_phase.items():
                hist = m.step_latency.labels(w, phase)
                for seconds in values:
                    hist.observe(seconds)
        for dl in dead:
            m.dead_letters.labels(w, dl.reason.value).inc()
        m.busy_slots.labels(w).set(self.scheduler.table.busy_slots)


__all__ = ["LoopStats", "Reason", "Worker", "WorkerSettings"]
