"""One fused call on one lane (one engine), and what the worker does when the engine fails it.

On failure the offending sessions are answered and the rest run again: without the slots the engine
named (`EngineError.slots`; those it could not put back, `EngineError.lost`, answered `state_lost`), else
by bisection. A failure concerns the lane's engine only: no other lane's session is in the call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from schemas import Reason, Sampling, Status

from ..batch import EngineOutput
from ..engines.base import EngineError
from ..engines.compute import compute_thread, on_compute_thread
from ..metrics import Metrics
from ..sampling import BatchSampler
from ..sampling.stage import plain
from ..sched import Answer, ScheduledBatch
from ..sched.chaining import Successor
from ..transport.protocol import FusedCallStats
from .chain import Link, forward_ranked, run_chain
from .idle import IdleSessions
from .lane import Lane, mark_answered
from .sampled import apply_sampled
from .stats import LoopStats

__all__ = ["CallContext", "EngineIdle", "InFlightCall", "finish_fused", "run_fused", "run_here"]

log = logging.getLogger("dgr.worker")


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a fused call's helpers use of the worker: where they count (stats, metrics under the worker's
    id), whether calls run on the compute thread (`overlap`), the idle clock its answers touch."""

    worker_id: str
    overlap: bool
    stats: LoopStats
    metrics: Metrics
    idle: IdleSessions | None


def run_fused(w: CallContext, lane: Lane, batch: ScheduledBatch, idle: EngineIdle | None = None,
              counted: bool = False) -> list[Answer]:
    """One fused call, in the loop's thread. On failure, answer the offending sessions `failed` and keep
    serving the rest: retry without the slots the engine named, else bisect. `idle`: told when the engine's call
    started (`counted`: a call ran just before, the engine's idle since is counted) and ended."""
    t = time.perf_counter()
    fused = lane.hops.fused(batch)
    try:
        # With overlap on, every call runs on the compute thread, the one the engine was built on and the
        # overlapped calls run on (consumer/engines/compute.py: a second OpenMP team slows every call).
        run = partial(forward_ranked, lane.engine, lane.prefix, batch)
        output, started, ended = on_compute_thread(run, fused) if w.overlap else run(fused)
    except Exception as e:  # any engine fault must not take the worker down
        answers = _failed(w, lane, batch, e, time.perf_counter() - t)
        if idle is not None:  # the failed call and its retries, as the engine's time
            idle.entered(t, counted=counted)
            idle.ended(time.perf_counter())
        return answers
    if idle is not None:
        idle.entered(started, counted=counted)
        idle.ended(ended)
    return _answered(w, lane, batch, output, ended - started)


def run_here(w: CallContext, idle: EngineIdle, lane: Lane, batch: ScheduledBatch, *,
             after_call: bool) -> tuple[list[Answer], FusedCallStats]:
    """The fused call in the loop's thread (overlap off): its answers and stats. `after_call`: a call ran just
    before (the engine's idle since is counted)."""
    before = w.stats.engine_seconds
    answers = run_fused(w, lane, batch, idle, after_call)
    engine_s = w.stats.engine_seconds - before  # the engine alone (all tries, if it failed)
    return answers, FusedCallStats(phase=batch.phase, batch_size=len(batch.session_ids), tokens=len(batch.fused),
                                   engine_seconds=engine_s)


def finish_fused(w: CallContext, lane: Lane, batch: ScheduledBatch, out: EngineOutput | Exception,
                 elapsed: float) -> list[Answer]:
    """The answers of a call the engine thread ran (InFlightCall); a failure as in run_fused (its retries then
    run in the loop's thread)."""
    if isinstance(out, Exception):
        return _failed(w, lane, batch, out, elapsed)
    return _answered(w, lane, batch, out, elapsed)


def _failed(w: CallContext, lane: Lane, batch: ScheduledBatch, e: Exception, elapsed: float) -> list[Answer]:
    w.stats.engine_seconds += elapsed
    w.metrics.engine_failures.labels(w.worker_id).inc()
    detail = f"{type(e).__name__}: {e}"[:200]
    sessions = batch.session_ids
    log.warning("fused call failed", extra={"sessions": len(sessions), "error": detail, "engine": lane.name})
    named = set(e.slots) if isinstance(e, EngineError) else set()
    bad = [i.job.session_id for i in batch.items if i.slot in named]
    if bad or len(sessions) == 1:
        return _fail_named(w, lane, batch, e, bad or list(sessions), detail)
    half = set(sessions[: len(sessions) // 2])
    first, second = batch.without([s for s in sessions if s not in half]), batch.without(half)
    return [o for part in (first, second) if part is not None for o in run_fused(w, lane, part)]


def _answered(w: CallContext, lane: Lane, batch: ScheduledBatch, output: EngineOutput, elapsed: float) -> list[Answer]:
    w.stats.count_call(batch.phase, len(batch.session_ids), elapsed)
    lane.fused_calls += 1
    lane.pacer.observe(batch.phase, len(batch.fused), elapsed)
    sched = lane.scheduler
    if output.kind == "hidden":  # a hop that is not last answers activations, no sampling
        try:
            tokens: Sequence[int | None] = lane.hops.collect(batch, output)
        except Exception as e:  # the engine ran (its state moved) but its rows are unusable: no retry
            log.warning("hop output refused", extra={"sessions": len(batch.session_ids), "error": str(e)})
            return sched.fail(batch, f"hop output: {e}"[:200])
        outcomes = sched.update_from_output(batch, tokens, elapsed)
    else:  # the last hop (or a whole model) samples
        outcomes = apply_sampled(sched, batch, lane.sampler.sample(batch, output), elapsed)
    if w.idle is not None:
        for o in outcomes:
            w.idle.touch(o.result.session_id)
    mark_answered(lane, outcomes)
    return outcomes


def _fail_named(w: CallContext, lane: Lane, batch: ScheduledBatch, e: Exception, bad: Sequence[str],
                detail: str) -> list[Answer]:
    """Answer the sessions the engine named (all of a one-session call) and run the rest again: the
    engine put every other slot back. A slot it could not put back (`EngineError.lost`: a recurrent
    state moved with no snapshot) is answered `state_lost` (the Tracker replays it); a call the
    engine refused for a reason of its own before running it, with that reason."""
    lost_slots = set(e.lost) if isinstance(e, EngineError) else set()
    lost = {i.job.session_id for i in batch.items if i.slot in lost_slots}
    reason = e.reason if isinstance(e, EngineError) else Reason.ENGINE_ERROR
    sched = lane.scheduler
    out: list[Answer] = []
    for part_ids, status in ((lost, Status.STATE_LOST), (set(bad) - lost, None)):
        part = batch.without([s for s in batch.session_ids if s not in part_ids]) if part_ids else None
        if part is None:
            continue
        if status is Status.STATE_LOST:
            out += sched.fail(part, f"state lost: {detail}", status=status, reason=Reason.ENGINE_ERROR)
        else:
            out += sched.fail(part, detail, reason=reason,
                              status=Status.FAILED if reason == Reason.ENGINE_ERROR else Status.REJECTED)
    good = batch.without(bad)
    return out + (run_fused(w, lane, good) if good is not None else [])


class EngineIdle:
    """The engine's idle between two fused calls of consecutive loop iterations, the critical path of issue 32:
    from the end of the engine's call k to the start of its call k + 1, as the thread that ran them read the clock
    (chain.forward_ranked), counted when the loop ran k + 1 in the iteration after k (work went on: with overlap off
    that includes the filing, the read, and a wait for a job when no session holds credit). So the first cut after
    a call, the hand-overs to and from the compute thread and their waits for the GIL are idle, not engine time.
    In stats.engine_gaps, stats.engine_gap_seconds and the dgr_engine_gap_seconds histogram."""

    __slots__ = ("ctx", "ended_at")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.ended_at: float | None = None  # time.perf_counter() at the end of the last call

    def entered(self, at: float, *, counted: bool) -> None:
        if counted and self.ended_at is not None:
            gap = max(0.0, at - self.ended_at)
            stats = self.ctx.stats
            stats.engine_gaps += 1
            stats.engine_gap_seconds += gap
            self.ctx.metrics.child(self.ctx.metrics.engine_gap, self.ctx.worker_id).observe(gap)

    def ended(self, at: float) -> None:
        self.ended_at = at


class InFlightCall:
    """The fused call on the engine thread (overlap on: the loop builds the next call's input and files
    the last one's answers while it computes), and the call chained after it (`offer`: worker/chain.py). One
    thread runs every call, one at a time, so an engine is never entered by two threads; slots are released
    only while no call is in flight. The thread is the process's compute thread (consumer/engines/compute.py),
    shared by the workers of a process."""

    def __init__(self, ctx: CallContext, idle: EngineIdle) -> None:
        self.ctx = ctx
        self.idle = idle
        self._lock = threading.Lock()  # a link's offer, between the loop and the engine thread
        # (lane, the call as handed out (None: a chained call none of whose sessions is open any more), its link on
        # the engine thread, the link's output rows it keeps (None: all))
        self._call: tuple[Lane, ScheduledBatch | None, Link, list[int] | None] | None = None

    @property
    def busy(self) -> bool:
        return self._call is not None

    def start(self, lane: Lane, batch: ScheduledBatch, *, after_finish: bool = False) -> None:
        """Start the call on the engine thread. `after_finish`: the loop took the last call in this iteration and
        started this one at once: the engine's idle in between is counted (EngineIdle)."""
        assert self._call is None, "one fused call in flight at a time"
        link = Link(batch, lane.hops.fused(batch))
        fill = partial(_fill, lane.sampler)
        compute_thread().submit(run_chain, lane.engine, lane.prefix, link, self._lock, fill)
        # Hand the GIL over until the engine thread is in: otherwise the loop's next Python work holds it and
        # the call starts up to a switch interval (5 ms) late (measured: 0.6 ms median at 256 sessions).
        link.entered.wait()
        self._call = (lane, batch, link, None)
        self.idle.entered(link.entered_at, counted=after_finish)

    def offer(self, successor: Successor) -> bool:
        """Offer the call to run after the one in flight; False when the engine thread is past taking it."""
        c = self._call
        if c is None:
            return False
        link = c[2]
        nxt = Link(successor.batch, successor.batch.fused, successor)
        with self._lock:
            if link.taken or link.offer is not None:
                return False
            link.offer = nxt
        return True

    def chain_next(self) -> None:
        """Offer the decode call that follows the one computing, when the scheduler can tell it now (whole-model
        calls: consumer/sched/chaining.py)."""
        c = self._call
        if c is None or c[1] is None or c[2].offer is not None or c[0].hops.consumes_hidden \
                or c[0].hops.produces_hidden or (c[3] is not None and len(c[3]) < len(c[2].fused)):
            return  # (a chained call adopted without some of its rows: Scheduler.successor)
        successor = c[0].scheduler.successor(c[1], plain)
        if successor is not None:
            self.offer(successor)

    def withdraw(self) -> None:
        """The offered call no longer follows (a cancellation, a session ready that it leaves out), if the engine
        thread has not taken it."""
        c = self._call
        if c is not None:
            with self._lock:
                c[2].offer = None

    def wait(self) -> None:
        """Wait until the engine is idle: the call in flight (if any) and any call chained after it have ended on
        the engine thread; the loop still finishes them."""
        c = self._call
        if c is not None:
            self.withdraw()
            link: Link | None = c[2]
            while link is not None:
                link = link.result.result()[3]

    def finish(self) -> tuple[Lane, list[Answer], FusedCallStats] | None:
        """The call in flight's lane, answers (waiting for it) and stats (None: no call). When the engine thread
        went on with the call offered after it, that call is adopted (Scheduler.adopt) and is in flight now."""
        c, self._call = self._call, None
        if c is None:
            return None
        lane, batch, link, rows = c
        out, elapsed, ended, nxt = link.result.result()
        stats = self.ctx.stats
        before = stats.engine_seconds
        if rows is not None:  # chained: the engine's idle since the call before, its start now known
            self.idle.entered(link.entered_at, counted=True)
        self.idle.ended(ended)
        if batch is None:  # chained, and every session of it closed meanwhile: nothing to answer
            stats.engine_seconds += elapsed
            answers: list[Answer] = []
        else:
            if rows is not None and not isinstance(out, Exception) and len(rows) < len(link.fused):
                out = out.take(rows)  # the rows of the sessions it kept (one each)
            answers = finish_fused(self.ctx, lane, batch, out, elapsed)
        engine_s = stats.engine_seconds - before  # the engine alone (all tries, if it failed)
        if nxt is not None:
            assert nxt.successor is not None
            adopted = lane.scheduler.adopt(nxt.successor)
            answers += adopted.answers
            self._call = (lane, adopted.batch, nxt, adopted.rows)
        return lane, answers, FusedCallStats(phase=link.batch.phase, batch_size=len(batch.session_ids) if batch else 0,
                                             tokens=len(batch.fused) if batch else 0, engine_seconds=engine_s)

    def abandon(self) -> None:
        """On the way out after an error: the engine finishes its calls, nothing is answered (their entries stay
        pending: a successor answers them)."""
        self.wait()
        self._call = None

    def close(self) -> None:
        self.abandon()  # the compute thread is the process's: it stays


def _fill(sampler: BatchSampler, successor: Successor, before: Link, out: EngineOutput) -> bool:
    """On the engine thread: the offered call's inputs, the argmax of the call before's rows (what the loop's
    sampler will give them: BatchSampler.greedy_tokens), unless one is not a token its session may sample or
    ends its session. Every row of the call before is a plain greedy one (Scheduler.successor checked)."""
    if out.kind != "logits":
        return False
    tokens = sampler.greedy_tokens(out.rows, partial(_samplings, before), out.top)
    return tokens is not None and successor.fill(tokens)


def _samplings(link: Link) -> list[Sampling | None]:
    """The sampling of each of a link's rows (one per row: decode calls)."""
    if link.successor is not None:
        return [lane.entry.spec.sampling for lane, _, _ in link.successor.rows]
    return [it.sampling for it in link.batch.sampling_items]
