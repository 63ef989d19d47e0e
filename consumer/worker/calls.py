"""One fused call on one lane (one engine), and what the worker does when the engine fails it.

On failure the offending sessions are answered and the rest run again: without the slots the engine
named (`EngineError.slots`; those it could not put back, `EngineError.lost`, answered `state_lost`), else
by bisection. A failure concerns the lane's engine only: no other lane's session is in the call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from schemas import Reason, Status

from ..engines.base import EngineError
from ..sched import Answer, ScheduledBatch
from .lane import Lane
from .sampled import apply_sampled

if TYPE_CHECKING:
    from .loop import Worker

__all__ = ["run_fused"]

log = logging.getLogger("dgr.worker")


def run_fused(w: Worker, lane: Lane, batch: ScheduledBatch) -> list[Answer]:
    """One fused call. On failure, answer the offending sessions `failed` and keep serving the rest:
    retry without the slots the engine named, else bisect."""
    t = time.perf_counter()
    try:
        output = lane.engine.forward(lane.hops.fused(batch))
    except Exception as e:  # any engine fault must not take the worker down
        w.stats.engine_seconds += time.perf_counter() - t
        w.metrics.engine_failures.labels(w.settings.worker_id).inc()
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
    elapsed = time.perf_counter() - t
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
    w.admission.answered(lane, outcomes)
    return outcomes


def _fail_named(w: Worker, lane: Lane, batch: ScheduledBatch, e: Exception, bad: Sequence[str],
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
