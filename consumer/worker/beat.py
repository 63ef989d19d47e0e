"""The worker's heartbeat: its lease renewed, its heartbeat and prefix summary written, its input streams' lag
read (metrics, and the drained worker's exit), acked input entries trimmed: five Redis round trips.

On Gemma's in-order path (docs/benchmarks.md, issue 32) the engine waited for it between two calls: 1.5-2 ms a
beat (the bench's beats every 0.2 s cost 0.49 ms a call averaged; moving them off took 0.6 ms a call off the idle).
So with `overlap` on the loop hands the beat to the I/O thread (after the filings handed over before it, in
order) and goes on; the values it needs from the loop's state (the heartbeat's body, the prefix summary, the busy
slots) are taken when it is due, in the loop's thread.
"""

from __future__ import annotations

import logging
import os
import threading

from schemas.limits import MAX_CONTINUATION
from schemas.prefix import PrefixSummary

from ..engines.engine_set import EngineSet
from ..metrics import Metrics
from ..transport.protocol import Transport
from .lane import Lanes
from .stats import LoopStats

log = logging.getLogger("dgr.worker")

__all__ = ["beat", "heartbeat_body"]


def beat(tr: Transport, info: dict[str, object], summary: PrefixSummary | None, metrics: Metrics, worker: str,
         exit_when_drained: bool, busy_slots: int, stop: threading.Event) -> None:
    """One beat. LeaseLost when another process took over (a long pause); `stop` is set when the worker drains
    (`exit_when_drained`), holds no session (`busy_slots` when the beat was due) and its streams are empty."""
    tr.renew_lease()
    tr.heartbeat(info, summary)  # docs/prefix-cache.md
    lags = tr.input_lag()
    for stream, lag in lags.items():
        metrics.input_lag.labels(worker, stream).set(lag.get("lag", 0))
        metrics.input_pending.labels(worker, stream).set(lag.get("pending", 0))
    if exit_when_drained and getattr(tr, "draining", False) and not busy_slots \
            and not any(v.get("lag", 0) or v.get("pending", 0) for v in lags.values()):
        log.info("drained and empty: stopping", extra={"worker": worker})
        stop.set()
    tr.trim()


def heartbeat_body(worker: str, started_at: float, engines: EngineSet, lanes: Lanes, stats: LoopStats
                   ) -> dict[str, object]:
    """The heartbeat's body: the first engine's fields as a one-engine worker always advertised (slots and
    busy_slots: the worker's, every engine's together), and `engines`: per engine what `EngineSet.advertise()`
    says, its busy slots, calls and `describe()`."""
    first = lanes[0]
    cap, sched = first.engine.capacity, first.scheduler
    per_engine = [{**ad, **lane.info()} for ad, lane in zip(engines.advertise(), lanes, strict=True)]
    return {"worker_id": worker, "pid": os.getpid(), "started_at": started_at,
            "slots": lanes.slots(), "busy_slots": lanes.busy_slots(), "engines": per_engine,
            "scheduler": sched.stats.as_dict(),
            "ctx_per_session": cap.ctx_per_session, "max_batch": sched.config.max_batch,
            "max_continuation": MAX_CONTINUATION,  # the producer asks for n > 1 only when advertised
            "prefill_budget": sched.config.prefill_budget, "prefill_max": first.pacer.max_tokens,
            "prefill_ratio": first.pacer.ratio, "vocab_size": cap.vocab_size,
            "engine": first.engine.describe(), "stats": stats.snapshot()}
