"""Prometheus metrics of one worker (prometheus-client), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self, worker_id: str, registry: CollectorRegistry | None = None) -> None:
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
        self.results = Counter("dgr_results", "Step results by status and reason", ["worker", "status", "reason"],
                               registry=r)
        self.dead_letters = Counter("dgr_dead_letters", "Entries dead-lettered", ["worker", "reason"], registry=r)
        self.input_lag = Gauge("dgr_input_lag_entries", "Entries not yet delivered, per input stream",
                               ["worker", "stream"], registry=r)
        self.busy_slots = Gauge("dgr_busy_slots", "Sequence slots held by sessions", ["worker"], registry=r)
        self.engine_failures = Counter("dgr_engine_failures", "Fused calls that raised", ["worker"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
