"""One loop iteration's metrics (consumer/metrics.py): the fused call, the answers by status, TTFT and
inter-token latency, step latency, dead letters, busy slots. Counted per label set first, then one
`labels()` lookup each: this runs for every session of every call."""

from __future__ import annotations

import time
from collections.abc import Sequence

from schemas import Phase, Reason, Status

from ..metrics import Metrics, observe_many
from ..sched import Answer
from ..transport.protocol import DeadLetter, FusedCallStats

__all__ = ["observe_iteration"]


def observe_iteration(m: Metrics, worker: str, call: FusedCallStats | None, completions: Sequence[Answer],
                      dead: Sequence[DeadLetter], latencies: Sequence[tuple[Phase, float]], busy_slots: int) -> None:
    if call is not None:
        m.child(m.batch_size, worker, call.phase).observe(call.batch_size)
        m.child(m.tokens, worker, call.phase).inc(call.tokens)
        m.child(m.engine_seconds, worker, call.phase).inc(call.engine_seconds)
    # counted by the enum members (an enum's .value is a property: twice per answer otherwise), named once
    outcomes: dict[tuple[Status, Reason | None], int] = {}
    for c in completions:
        r = c.result
        key = (r.status, r.reason)
        outcomes[key] = outcomes.get(key, 0) + 1
    for (status, reason), n in outcomes.items():
        m.child(m.results, worker, status.value, reason.value if reason else "").inc(n)
    m.observe_answers(completions, time.time())  # TTFT and inter-token latency
    if latencies:
        by_phase: dict[Phase, list[float]] = {}
        for phase, seconds in latencies:
            by_phase.setdefault(phase, []).append(seconds)
        for phase, values in by_phase.items():
            observe_many(m.child(m.step_latency, worker, phase), values)
    for dl in dead:
        m.dead_letters.labels(worker, dl.reason.value).inc()
    m.child(m.busy_slots, worker).set(busy_slots)
