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
import threading

from schemas.prefix import PrefixSummary

from ..metrics import Metrics
from ..transport.protocol import Transport

log = logging.getLogger("dgr.worker")

__all__ = ["beat"]


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
