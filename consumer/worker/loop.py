"""The batching worker loop: read -> admit -> cancellations -> one fused engine call -> complete.

It joins parts that know nothing of each other: the transport (all Redis I/O, consumer/transport/), the
scheduler (pure decisions, consumer/sched/), the engine (one forward pass per call) and the sampler.
Nothing here speaks Redis. The delivery rules (exactly one real answer per step) are delivery.py's,
the reading and admission of entries admission.py's, the I/O thread io_thread.py's.

Steady state (sessions decoding under continuation credit, consumer/worker/io_thread.py): the loop
never waits for Redis, and the engine waits for the loop only as long as it takes to sample call k and
build call k+1. With `overlap` on, fused calls run on an engine thread (calls.py `InFlightCall`; the
engine releases the GIL): the loop finishes call k (samples it, the scheduler takes the tokens), starts
call k+1 at once, and only then does the rest of call k's work while k+1 computes: its answers to the
delivery ledger and the I/O thread (which files them), metrics, the next admission and cancellations.
With `chain` on (plain greedy decode calls) the engine does not wait for that either: call k+1 is built
while k computes and the engine thread starts it when k ends (worker/chain.py), and the loop finishes k
while k+1 computes.
The I/O thread likewise reads ahead while a call computes. The loop reads for itself (blocking up to
`block_ms`) only when it has nothing to run, and waits up to `await_ms` for the next steps of sessions
that hold no credit (a Tracker that pushes one job per token). With `overlap` off (or calls longer than
`overlap_max_call_ms`: a CPU engine whose threads want both cores) the call runs in the loop's thread, its
reads and filing still on the I/O thread (`overlap_io`); with `overlap` off everything runs in order.

Several engines (an `EngineSet`: a small and a large model, one per state layout): one lane per engine
(lane.py), each with its own streams, scheduler, sampler and slots. One read covers every lane's
streams; each fused call is one lane's (lanes taken in weighted round-robin among those with work), so
one call never mixes engines and an engine's failure touches its own sessions only.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from types import FrameType

from schemas import Phase, Reason

from ..config import WorkerSettings
from ..engines.base import Engine
from ..engines.engine_set import EngineSet
from ..metrics import Metrics
from ..prefix.run import prefix_summary
from ..sched import Answer
from ..transport.errors import LeaseLost, Stopping
from ..transport.protocol import Closure, DeadLetter, Filing, FusedCallStats, Transport
from .admission import Admitted, EntryAdmission, Prefetched
from .beat import beat, heartbeat_body
from .calls import CallContext, EngineIdle, InFlightCall, run_here
from .idle import IdleSessions
from .io_thread import Handed, IOThread
from .lane import Lane, Lanes, read_lanes_ahead
from .observe import observe_iteration
from .stats import LoopStats

__all__ = ["DEFAULT_ENGINE", "LoopStats", "Reason", "Worker", "WorkerSettings"]

log = logging.getLogger("dgr.worker")

DEFAULT_ENGINE = "main"  # the name of a worker's engine when it is given one engine, not a set


class Worker:
    def __init__(self, engine: Engine | EngineSet, transport: Transport, settings: WorkerSettings,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.engines = engine if isinstance(engine, EngineSet) else EngineSet({DEFAULT_ENGINE: engine})
        self.transport = transport
        self.settings = settings
        self.metrics = metrics or Metrics(settings.worker_id)
        self.lanes = Lanes(self.engines, settings, transport)
        # The first (or only) lane's parts under the names a one-engine worker always had.
        first = self.lanes[0]
        self.engine, self.keys, self.scheduler, self.sampler = first.engine, first.keys, first.scheduler, first.sampler
        self.hops, self.pacer, self.ledger = first.hops, first.pacer, first.ledger
        self.idle = IdleSessions(settings.idle_session_s, clock) if settings.idle_session_s > 0 else None
        self.stats = LoopStats()
        self.calls = CallContext(settings.worker_id, settings.overlap, self.stats, self.metrics, self.idle)
        self.engine_idle = EngineIdle(self.calls)  # the engine's idle between two calls (both paths)
        self.in_flight = InFlightCall(self.calls, self.engine_idle)  # overlap on: the fused call on the engine thread
        self.admission = EntryAdmission(self.lanes, transport, settings, self.stats, self.idle,
                                        lambda: self.in_flight.busy, self.in_flight.wait)
        self._registered = False
        self._stop = threading.Event()
        self._last_heartbeat = 0.0
        self._last_recover = 0.0
        self._started = time.time()
        self._m = settings.worker_id
        self._outages_seen = 0
        self.io = IOThread(f"dgr-io-{self._m}")
        self._prefetched: Handed[Prefetched] | None = None
        self._last_call_s = 0.0  # the engine time of the last fused call (the overlap's length rule)
        self._called = False  # the last iteration ran (or started) a fused call

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        # One live consumer per worker id: wait as a standby (or refuse) while another holds the lease.
        self.transport.acquire_lease(wait=self.settings.standby)
        # A fresh scheduler believes every slot is free: make the engine agree, whatever it held before.
        for lane in self.lanes:
            for slot in range(lane.engine.capacity.n_slots):
                lane.engine.release(slot)
        names = self._register()
        self.metrics.set_capacity(self.lanes.slots(), self.scheduler.config.max_batch)
        self._registered = True
        log.info("worker ready", extra={"worker": self._m, "streams": names, "engine": self.engine.describe(),
                                        "engines": list(self.engines)})
        self._last_recover = time.monotonic()
        self._outages_seen = self.transport.outages
        self._recover()

    def request_stop(self, *_: object) -> None:
        """Stop after the fused call in flight; a wait on Redis (an outage, a standby) ends at once."""
        self._stop.set()
        stop = getattr(self.transport, "request_stop", None)
        if stop is not None:
            stop()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("stop requested", extra={"signal": signum})
            self.request_stop()
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self, max_idle_s: float | None = None) -> None:
        """Serve until stopped. The in-flight fused call always completes; unread entries stay queued."""
        try:
            if not self._registered:
                self.start()
        except Stopping:
            log.info("stopped before serving", extra={"worker": self._m})
            return
        idle_since = time.monotonic()
        try:
            try:
                while not self._stop.is_set():
                    if self.run_once(**self._mode()):
                        idle_since = time.monotonic()
                    elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                        break
                self.flush()  # the last call's results are out before the last heartbeat
            except BaseException:
                self.in_flight.abandon()  # the engine finishes its call before anything is torn down
                self._drain_quietly()  # what the I/O thread holds finishes (or fails) before the error goes on
                raise
        except LeaseLost:
            # Another process serves this worker id now: write nothing more (no heartbeat, no release).
            log.error("lease lost to another consumer: stopping without writing", extra={"worker": self._m})
            self.io.close()
            raise
        except Stopping:
            # Told to stop while Redis was unreachable: what was read stays pending for recovery.
            log.warning("stopped while redis was unreachable: entries left pending", extra={"worker": self._m})
            self.io.close()
            return
        try:
            # the last word: what it held at exit
            self.transport.heartbeat({**self._info(), "stopped": True}, prefix_summary(self.lanes, self.metrics))
            self.transport.release_lease()
        except Stopping:
            log.warning("stopped while redis was unreachable: lease left to expire", extra={"worker": self._m})
        log.info("worker stopped", extra={"worker": self._m, "fused_calls": self.stats.fused_calls})
        self.io.close()
        self.in_flight.close()
        for lane in self.lanes:
            lane.sampler.close()  # its grammars hold the engine's vocabulary: freed before the engine is

    # ---- the I/O thread ---------------------------------------------------------------------
    def _mode(self) -> dict[str, bool]:
        """run_once's keywords: calls on the engine thread while they are short (settings.overlap), else in the
        loop's thread with the Redis round trips on the I/O thread (overlap_io), else everything in order."""
        st = self.settings
        short = st.overlap_max_call_ms <= 0 or 1e3 * self._last_call_s <= st.overlap_max_call_ms
        if st.overlap and (short or st.overlap_io):
            return {"flush": False} if short else {"flush": False, "here": True}
        return {"flush": True}

    def flush(self) -> None:
        """Finish the call on the engine thread and file its answers, then wait for what the I/O thread
        holds (a prefetched read is kept for the next iteration); an error there (LeaseLost, a Redis
        outage given up on) is raised here, in the loop's thread."""
        self._settle_in_flight(flush=False)
        self.io.drain()

    def _drain_quietly(self) -> None:
        try:
            self.io.drain()
        except Exception:
            log.warning("the I/O thread failed while the loop was stopping on another error", exc_info=True)

    def _publish(self, filing: Filing, flush: bool) -> None:
        """transport.complete: at once (flush), or on the I/O thread (the loop goes on meanwhile)."""
        if not filing:
            return
        tr = self.transport

        def work() -> None:
            tr.complete(filing)

        if flush:
            self.io.drain()
            work()
        else:
            self.io.submit(work)

    # ---- the engine thread -------------------------------------------------------------------
    def _settle_in_flight(self, *, flush: bool) -> None:
        """Finish the calls on the engine thread (the one in flight, and one chained after it) and file their
        answers (before a synchronous iteration, a heartbeat or recovery sweep, and the stop)."""
        self.in_flight.withdraw()  # nothing more is chained
        settled = self.in_flight.busy
        while self.in_flight.busy:
            answers: list[list[Answer]] = [[] for _ in self.lanes]
            call = self._finish_in_flight(answers)
            latencies: list[tuple[Phase, float]] = []
            done = self.lanes.completions(answers, latencies)
            self._publish(Filing(done, closures=self._uncarried(done, []), call=call), flush)
            observe_iteration(self.metrics, self._m, call, done, (), latencies, self.lanes.busy_slots())
        if settled:
            # a finished session's save, kept until its answers are filed, runs before its next turn may be admitted
            self._release_slots()

    def _finish_in_flight(self, answers: list[list[Answer]]) -> FusedCallStats | None:
        """The call on the engine thread finished (waiting for it): its answers into answers[lane], its stats
        (None: no call); then the slots freed meanwhile are cleared (the engine is idle)."""
        done = self.in_flight.finish()
        if done is None:
            return None
        lane, got, call = done
        answers[lane.index].extend(got)
        self._last_call_s = call.engine_seconds
        self._release_slots(defer_saves=True)  # a finished session's save after its last answer is filed
        return call

    def _prefetch(self) -> None:
        """Hand the next read (entries, cancellations, activation blobs) to the I/O thread: it runs
        while the engine computes."""
        want = self.admission.want()
        tr, lanes = self.transport, self.lanes
        streams = lanes.streams

        def work() -> Prefetched:
            t = time.perf_counter()
            got, cancels, refused = read_lanes_ahead(tr, streams, want)  # one round trip
            return Prefetched(got, cancels, refused, lanes.fetch_blobs(tr, got), time.perf_counter() - t, want)

        self._prefetched = self.io.submit(work)

    # ---- one iteration ---------------------------------------------------------------------
    def run_once(self, *, flush: bool = True, here: bool = False) -> bool:
        """One iteration. flush=False (the loop, with `overlap` on): the next read and this call's
        completion may still be on the I/O thread on return; `here` (with flush=False): the call runs in the
        loop's thread, not on the engine thread, the next read on the I/O thread meanwhile."""
        t0 = time.perf_counter()
        if flush or here:
            self._settle_in_flight(flush=flush)  # a call started by an iteration on the engine thread
        self._housekeeping(in_line=flush)
        got = self._take_prefetched()
        admitted, cancelled, refused = self._intake(got)
        self.stats.read_seconds += admitted.read_s
        dead = admitted.dead + refused
        ending = cancelled + self._idle_sessions()
        if ending or any(lane.scheduler.has_work() for lane in self.lanes):
            self.in_flight.withdraw()  # a chained call would pass them over (consumer/sched/chaining.py)
        answers, not_held = self._cancellations(ending)
        t_wait = time.perf_counter()
        call = self._finish_in_flight(answers)  # call k, started by the last iteration (overlap on)
        waited = time.perf_counter() - t_wait if call is not None else 0.0
        chained = self.in_flight.busy  # the engine thread went on with the call chained after k
        picked = None if chained else self.lanes.next_call()  # one lane's call: its engine's sessions only
        if chained:
            self.stats.calls_by_iteration["chained"] += 1
            self._prefetch()
        elif picked is not None:
            lane, batch = picked
            self.stats.calls_by_iteration["in_order" if flush else "loop_thread" if here else "engine_thread"] += 1
            if not flush:
                self._prefetch()
            if not flush and not here:
                self.in_flight.start(lane, batch, after_finish=call is not None)  # call k + 1 computes from here on
            else:
                ran, call = run_here(self.calls, self.engine_idle, lane, batch,
                                     after_call=self._called or call is not None)
                answers[lane.index].extend(ran)
                self._last_call_s = waited = call.engine_seconds
        if not flush and not here and self.settings.chain and len(self.lanes) == 1:
            self.in_flight.chain_next()  # call k + 2 (worker/chain.py)
        self._called = chained or picked is not None
        latencies: list[tuple[Phase, float]] = []
        honest = self.lanes.completions(answers, latencies)
        refused_answers = admitted.wire_rejects + self.lanes.completions(admitted.answers, latencies)
        closures = self._uncarried([*honest, *refused_answers], not_held)
        if call is not None and (refused_answers or dead):
            # Refusals never stand in front of honest work in time: the call's answers are filed first,
            # the refusals and dead letters (up to max_read_entries of them: a burst of junk) after.
            self._publish(Filing(honest, closures=closures, call=call), flush)
            self._publish(Filing(refused_answers, dead, acks=admitted.acks), flush)
        else:
            self._publish(Filing(honest + refused_answers, dead, closures, admitted.acks, call), flush)
        completions = honest + refused_answers
        self.stats.round_trips = self.transport.round_trips
        self._release_slots()
        observe_iteration(self.metrics, self._m, call, completions, dead, latencies, self.lanes.busy_slots())
        if call is not None:
            # the worker's own time: the read is left out (mostly waiting for producers), see read_seconds,
            # and so is the wait for the engine (the whole call in the loop's thread, else what was left of it)
            self._count_overhead(t0, call, waited, admitted.read_s if got is None else 0.0)
        return bool(admitted.entries or completions or dead or picked is not None or admitted.acks
                    or self.in_flight.busy)

    def _intake(self, got: Prefetched | None) -> tuple[Admitted, list[str], list[DeadLetter]]:
        """What was read ahead (got) and, when needed, read now: admitted, and the cancellations (ids, and
        cancel entries refused). A call computing was preceded by a read ahead: reading again would only
        cost round trips."""
        if got is not None:
            admitted = self.admission.admit_all(got.inbound, got.fetched, got.asked)
            admitted.read_s += got.seconds
            cancelled, refused = list(got.cancels), list(got.refused)
        else:
            admitted, cancelled, refused = Admitted.empty(len(self.lanes)), [], []
        if got is None or (self.admission.should_read() and not self.in_flight.busy):
            admitted.extend(self.admission.read_and_admit())
            more, more_refused = self.transport.cancellations()
            cancelled, refused = cancelled + more, refused + more_refused
        return admitted, cancelled, refused

    def _cancellations(self, session_ids: Sequence[str]) -> tuple[list[list[Answer]], list[str]]:
        """Per lane the cancellations' answers, and the ids of sessions this worker does not hold."""
        answers: list[list[Answer]] = [[] for _ in self.lanes]
        not_held: list[str] = []
        for sid in session_ids:
            lane = self.lanes.holding(sid)
            if lane is None:
                not_held.append(sid)
            else:
                answers[lane.index].extend(self._cancel(lane, sid))
        return answers, not_held

    def _count_overhead(self, t0: float, call: FusedCallStats, waited: float, read_s: float) -> None:
        now = time.perf_counter()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("fused call", extra={"phase": call.phase, "sessions": call.batch_size, "rows": call.tokens,
                                           "engine_ms": round(1e3 * call.engine_seconds, 2),
                                           "read_ms": round(1e3 * read_s, 2), "loop_ms": round(1e3 * (now - t0), 2)})
        overhead = now - t0 - waited - read_s
        self.stats.overhead_seconds += overhead
        self.metrics.child(self.metrics.overhead, self._m).observe(overhead)

    def _take_prefetched(self) -> Prefetched | None:
        f, self._prefetched = self._prefetched, None
        return self.io.collect(f) if f is not None else None

    # ---- lanes -------------------------------------------------------------------------------
    def _register(self) -> Sequence[str]:
        """Every lane's keys (so its streams); the names the transport gives back (in key order): its streams."""
        names = self.transport.register(self.lanes.keys(), self._info())
        self.lanes.bind(names)
        return names

    # ---- sessions -----------------------------------------------------------------------------
    def _cancel(self, lane: Lane, session_id: str) -> list[Answer]:
        try:
            return lane.scheduler.cancel(session_id)
        except Exception:  # a valid id reaching a scheduler bug must not stop the loop; say so loudly
            log.exception("cancellation failed", extra={"session": session_id})
            return []

    def _idle_sessions(self) -> list[str]:
        """Open sessions with no step admitted or served for idle_session_s: cancelled like any other."""
        if self.idle is None:
            return []
        holding = self.lanes.holding
        due = self.idle.due(lambda sid: holding(sid) is not None,
                            lambda sid: (lane := holding(sid)) is not None and lane.scheduler.session_busy(sid))
        for sid in due:
            self.stats.sessions_idle_cancelled += 1
            log.info("idle session cancelled", extra={"session": sid, "idle_s": self.idle.idle_s})
        return due

    def _uncarried(self, completions: Sequence[Answer], cancelled_not_held: Sequence[str]) -> list[Closure]:
        """The closures no answer carries: a cancel with nothing queued, a failed engine call, a cancel of
        a session this worker does not hold (an earlier process may have charged it)."""
        carried = {c.result.session_id for c in completions if c.close is not None}
        todo = [Closure(cs.session_id, cs.kind, cs.account_id or None) for lane in self.lanes
                for cs in lane.scheduler.drain_closed() if cs.session_id not in carried]
        return todo + [Closure(sid, "cancelled") for sid in cancelled_not_held if sid not in carried]

    def _release_slots(self, *, defer_saves: bool = False) -> None:
        if self.in_flight.busy:
            return  # an engine is computing: its slots are cleared once the call is finished
        if self.lanes.deferred_saves():
            # The saves kept for after their sessions' last answers are filed: with `overlap` the filing may still
            # be on the I/O thread (handed over, not done), so it is waited for before the engine works on them.
            self.io.drain()
        self.lanes.release_slots(defer_saves=defer_saves)

    # ---- periodic --------------------------------------------------------------------------
    def _housekeeping(self, in_line: bool) -> None:
        now = time.monotonic()
        tr = self.transport
        due_beat = now - self._last_heartbeat >= self.settings.heartbeat_s
        due_recover = now - self._last_recover >= self.settings.recover_every_s
        if tr.outages != self._outages_seen or due_recover or (due_beat and in_line):
            # The lease check, the heartbeat, trims and the ownership sweep see the transport with
            # nothing in flight (the sweep reads which entries are still outstanding).
            self.flush()
        if tr.outages != self._outages_seen:
            self._after_outage()
        if due_beat:
            self._last_heartbeat = now
            work = partial(beat, tr, self._info(), prefix_summary(self.lanes, self.metrics), self.metrics, self._m,
                           self.settings.exit_when_drained, self.lanes.busy_slots(), self._stop)
            if in_line:
                work()
            else:  # after the filings handed over before it (worker/beat.py)
                self.io.submit(work)
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
        self._register()
        self._last_recover = time.monotonic()
        self._recover()

    def _recover(self) -> None:
        self.flush()
        admitted = self.admission.admit_all(self.transport.recover(), None)
        completions = admitted.wire_rejects + self.lanes.completions(admitted.answers, [])
        filing = Filing(completions, admitted.dead, acks=admitted.acks)
        if filing:
            self.transport.complete(filing)
        for dl in admitted.dead:
            self.metrics.dead_letters.labels(self._m, dl.reason.value).inc()

    def _info(self) -> dict[str, object]:
        return heartbeat_body(self._m, self._started, self.engines, self.lanes, self.stats)
