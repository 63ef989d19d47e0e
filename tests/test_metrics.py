"""The worker's Prometheus metrics move with the work it does."""

from __future__ import annotations

from pathlib import Path

import redis
from prometheus_client import generate_latest

from consumer.engines.reference import NumpyReferenceEngine

from .support import prompts
from .test_worker_inprocess import Driver, make_worker


def test_metrics_count_calls_tokens_results_and_slots(fake_redis: redis.Redis, tiny_model_path: Path) -> None:
    engine = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    worker = make_worker(fake_redis, engine)
    d = Driver(fake_redis, worker)
    for i, p in enumerate(prompts(3, 300, seed=4)):
        d.open(f"m{i}", p, max_tokens=4)
    for _ in range(30):
        worker.run_once()
        d.poll()
    text = generate_latest(worker.metrics.registry).decode()
    reg = worker.metrics.registry

    def value(name: str, **labels: str) -> float:
        v = reg.get_sample_value(name, {"worker": "inproc", **labels})
        return 0.0 if v is None else v

    assert value("dgr_fused_batch_sessions_count", phase="decode") == worker.stats.calls_by_phase["decode"]
    assert value("dgr_fused_batch_sessions_sum", phase="decode") == worker.stats.decode_sessions
    assert value("dgr_tokens_total", phase="prefill") == sum(len(p) for p in prompts(3, 300, seed=4))
    assert value("dgr_results_total", status="ok", reason="") == 3 * 4
    assert value("dgr_busy_slots") == 0  # all three finished and were released
    assert value("dgr_step_latency_seconds_count", phase="decode") == 3 * 3
    assert "dgr_loop_overhead_seconds" in text
