"""Prometheus metrics of one worker (prometheus-client), on a registry of its own.

Every metric the dashboard (deploy/grafana/dgr-worker.json) reads is declared here; tests/test_dashboard.py
checks that each name in the dashboard is one of them. Besides plain counters, three helpers keep what a
metric needs between fused calls:

* `observe_answers` (TTFT and inter-token latency): one call per fused call with its answers. The time
  to first token runs from the producer's push of the prompt's job (`created_at`) to the first token
  published for the session; the inter-token latency from one token of a session to its next. A token
  re-sent for a duplicate delivery (its position not past the last seen) is no sample.
* `outage_started` / `outage_ended`: the OutageListener of schemas/retry.py (the transport's rider
  calls them): a gauge while Redis is unreachable, a count and the seconds of outages ridden through.
* `durable_shortfall`: a completion too few replicas acknowledged (`--durable-replicas`), re-sent.
* `set_capacity`: slots and the most sessions a fused call may hold (the batch fill's denominator).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from schemas import Status, StepJob

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TRACKED_SESSIONS = 65_536  # sessions whose last token time is kept: bounded whatever the traffic


class ResultLike(Protocol):
    """What `observe_answers` reads of an answer's result (a scheduler `Outcome`, or a `StepResult`)."""

    @property
    def session_id(self) -> str: ...

    @property
    def status(self) -> Status: ...

    @property
    def position(self) -> int: ...

    @property
    def token(self) -> int | None: ...

    @property
    def finished(self) -> bool: ...


class AnswerLike(Protocol):
    """What `observe_answers` reads of an answer: its result and, when it answers a job, the job."""

    @property
    def result(self) -> ResultLike: ...

    @property
    def job(self) -> StepJob | None: ...


class Metrics:
    def __init__(self, worker_id: str, registry: CollectorRegistry | None = None) -> None:
        self.worker_id = worker_id
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram("dgr_fused_batch_sessions", "Sessions per fused engine call", ["worker", "phase"],
                                    buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("dgr_tokens", "Tokens run through the engine", ["worker", "phase"], registry=r)
        self.engine_seconds = Counter("dgr_engine_seconds", "Seconds inside fused engine calls", ["worker", "phase"],
                                      registry=r)
        self.step_latency = Histogram("dgr_step_latency_seconds", "Job created_at to result published",
                                      ["worker", "phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("dgr_loop_overhead_seconds", "Worker time per fused call outside the engine",
                                  ["worker"], buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05), registry=r)
        self.engine_gap = Histogram(
            "dgr_engine_gap_seconds", "The engine idle from a fused call's end to the next call's start, when the "
            "loop had that call ready (sampling, update, next batch, hand-over: the critical path)", ["worker"],
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05), registry=r)
        self.results = Counter("dgr_results", "Step results by status and reason", ["worker", "status", "reason"],
                               registry=r)
        self.dead_letters = Counter("dgr_dead_letters", "Entries dead-lettered", ["worker", "reason"], registry=r)
        self.input_lag = Gauge("dgr_input_lag_entries", "Entries not yet delivered, per input stream",
                               ["worker", "stream"], registry=r)
        self.input_pending = Gauge("dgr_input_pending_entries", "Entries delivered and not acked, per input stream",
                                   ["worker", "stream"], registry=r)
        self.busy_slots = Gauge("dgr_busy_slots", "Sequence slots held by sessions", ["worker"], registry=r)
        self.slots = Gauge("dgr_slots", "Sequence slots of the engine", ["worker"], registry=r)
        self.max_batch = Gauge("dgr_max_batch_sessions", "Most sessions one fused call may hold", ["worker"],
                               registry=r)
        self.engine_failures = Counter("dgr_engine_failures", "Fused calls that raised", ["worker"], registry=r)
        self.ttft = Histogram("dgr_time_to_first_token_seconds",
                              "Prompt job pushed (created_at) to the session's first token published", ["worker"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dgr_inter_token_latency_seconds",
                             "One token of a session published to its next one", ["worker"], buckets=ITL_BUCKETS,
                             registry=r)
        self.outages = Counter("dgr_redis_outages", "Redis outages ridden through (ended)", ["worker"], registry=r)
        self.outage_seconds = Counter("dgr_redis_outage_seconds", "Seconds Redis was unreachable, summed over "
                                      "the outages ridden through", ["worker"], registry=r)
        self.redis_unreachable = Gauge("dgr_redis_unreachable", "1 while Redis is unreachable (an outage under "
                                       "way), else 0", ["worker"], registry=r)
        self.prefix_cache = Gauge("dgr_prefix_cache", "Prefix cache per engine: lookups, hits, misses, hit_tokens "
                                  "(prompt tokens restored, not computed), saved, evictions, too_big (counts since "
                                  "start) and bytes (held now)", ["worker", "engine", "what"], registry=r)
        self.durable_shortfalls = Counter("dgr_durable_shortfalls", "Completion sends fewer replicas than "
                                          "--durable-replicas acknowledged in time (each re-sent)", ["worker"],
                                          registry=r)
        # Series that exist from the start (at 0), so a dashboard shows "none yet", not "no data".
        self.redis_unreachable.labels(worker_id).set(0)
        self.durable_shortfalls.labels(worker_id)
        self.engine_failures.labels(worker_id)
        self.engine_gap.labels(worker_id)  # exported from the start (a worker without overlap never observes it)
        # session -> (position, time) of its last token, in the order first seen: the oldest dropped past
        # TRACKED_SESSIONS (a session still decoding after that many newer ones loses one sample), not moved per token
        self._last_token: dict[str, tuple[int, float]] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: prometheus_client's `labels` checks and converts its values and takes
        the metric's lock at every call (about 5 us here, seven or more per fused call), for the same child each
        time (no series of these metrics is ever removed)."""
        key = (id(metric), labels)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*labels)
        return got

    def observe_prefix(self, engine: str, stats: dict[str, int], cached_bytes: int) -> None:
        """The prefix cache's counters of one engine (consumer/prefix/store.py CacheStats), as they stand."""
        for name, v in (*stats.items(), ("bytes", cached_bytes)):
            self.prefix_cache.labels(self.worker_id, engine, name).set(v)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def set_capacity(self, slots: int, max_batch: int) -> None:
        self.slots.labels(self.worker_id).set(slots)
        self.max_batch.labels(self.worker_id).set(max_batch)

    def observe_answers(self, answers: Iterable[AnswerLike], now: float) -> None:
        """TTFT and inter-token latency of the tokens among one fused call's answers (published at `now`,
        Unix time). A session's state is dropped when it finishes or gets a non-OK answer."""
        last = self._last_token
        ttft = self.child(self.ttft, self.worker_id)
        gaps: list[float] = []
        ok = Status.OK  # read once: an enum's member read from its class costs a lookup through the metaclass
        for a in answers:
            r = a.result
            sid = r.session_id
            if r.status != ok:
                last.pop(sid, None)
                continue
            if r.token is None:
                continue
            prev = last.get(sid)
            if prev is None:
                job = a.job
                if job is not None and job.phase == "prefill" and job.created_at:
                    ttft.observe(max(0.0, now - job.created_at))
            elif r.position > prev[0]:
                gaps.append(now - prev[1])
            else:
                continue  # a token answered again (a duplicate delivery): no new sample
            if r.finished:
                last.pop(sid, None)
                continue
            if prev is None and len(last) >= TRACKED_SESSIONS:
                del last[next(iter(last))]
            last[sid] = (r.position, now)
        if gaps:
            observe_many(self.child(self.itl, self.worker_id), gaps)

    # schemas/retry.py's OutageListener
    def outage_started(self) -> None:
        self.redis_unreachable.labels(self.worker_id).set(1)

    def outage_ended(self, down_s: float) -> None:
        self.redis_unreachable.labels(self.worker_id).set(0)
        self.outages.labels(self.worker_id).inc()
        self.outage_seconds.labels(self.worker_id).inc(down_s)

    def outage_gave_up(self, down_s: float) -> None:
        self.outage_seconds.labels(self.worker_id).inc(down_s)

    def durable_shortfall(self) -> None:
        """The transport's durable completions (consumer/transport/durable.py): too few replicas in time."""
        self.durable_shortfalls.labels(self.worker_id).inc()


# Fewer values than this are counted by a bisect each, in Python: numpy's five calls cost more than that loop until
# about this many (a fused call of 8 sessions observes 8 gaps; timeit, docs/benchmarks.md, issue 32).
BULK_VALUES = 96


def observe_many(hist: Any, values: Sequence[float]) -> None:
    """`hist.observe(v)` for every value (clamped at 0), in one pass: one bucket search over all of them
    (numpy, or a bisect per value for fewer than BULK_VALUES) and one increment per bucket hit, not a Python loop
    over the bounds per value (a fused call of 256 sessions observes 256 inter-token gaps). Reads
    prometheus_client's own child fields (`_upper_bounds`, `_buckets`, `_sum`: the ones its `observe` uses);
    tests/test_metrics.py checks the exposition equals one `observe` per value."""
    buckets = hist._buckets
    if len(values) < BULK_VALUES:
        bounds = hist._upper_bounds
        hits: dict[int, int] = {}
        total = 0.0
        for v in values:
            v = v if v > 0.0 else 0.0
            total += v
            i = bisect_left(bounds, v)
            hits[i] = hits.get(i, 0) + 1
        hist._sum.inc(total)
        for i, n in hits.items():
            buckets[i].inc(n)
        return
    arr = np.asarray(values, dtype=np.float64)
    arr = np.where(arr > 0.0, arr, 0.0)  # NaN too, as the bisect's and max(0.0, v) clamp it
    idx = np.searchsorted(np.asarray(hist._upper_bounds, dtype=np.float64), arr, side="left")
    counts = np.bincount(idx, minlength=len(buckets))
    hist._sum.inc(float(arr.sum()))
    for i in np.flatnonzero(counts).tolist():
        buckets[i].inc(int(counts[i]))
