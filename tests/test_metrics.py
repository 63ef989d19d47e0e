"""The worker's Prometheus metrics move with the work it does."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
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


_EDGES = [0.0, 0.001, 0.0025, 0.004, 0.1, 0.25, 7.5, 1e6, -0.5, 0.05, 0.05]
_VALUE = st.one_of(st.sampled_from(_EDGES), st.floats(-1.0, 10.0), st.just(float("nan")))


@settings(max_examples=60, deadline=None)
@given(values=st.one_of(st.just(_EDGES), st.lists(_VALUE, max_size=95), st.lists(_VALUE, min_size=96, max_size=300)))
def test_observe_many_equals_one_observe_per_value(values: list[float]) -> None:
    """The bulk histogram update the loop uses for inter-token gaps and step latencies: the same buckets and count
    as observe() per value, the same sum up to float summation order (values on bucket bounds, between them, above
    the last finite one, negative: clamped at 0 as the loop does), whether fewer than BULK_VALUES (a bisect each)
    or more (numpy)."""
    from prometheus_client import CollectorRegistry, Histogram

    from consumer.metrics import observe_many

    out = []
    for bulk in (False, True):
        reg = CollectorRegistry()
        h = Histogram("x_seconds", "x", ["w"], buckets=(0.001, 0.0025, 0.05, 0.25, 5.0), registry=reg)
        child = h.labels("w")
        if bulk:
            observe_many(child, values)
        else:
            for v in values:
                child.observe(max(0.0, v))
        out.append({(smp.name, smp.labels.get("le")): smp.value for m in reg.collect() for smp in m.samples
                    if not smp.name.endswith("_created")})
    one, bulk_ = out
    assert one.pop(("x_seconds_sum", None)) == pytest.approx(bulk_.pop(("x_seconds_sum", None)))
    assert one == bulk_ and one[("x_seconds_count", None)] == len(values)
    if values is _EDGES:
        assert one[("x_seconds_bucket", "0.001")] == 3


def test_a_kept_child_is_the_labelled_series() -> None:
    """Metrics.child gives what labels() gives (the same series, updated where the exposition reads it), one per
    metric and label values."""
    from consumer.metrics import Metrics

    m = Metrics("w")
    assert m.child(m.tokens, "w", "decode") is m.tokens.labels("w", "decode")
    assert m.child(m.tokens, "w", "decode") is not m.child(m.tokens, "w", "prefill")
    assert m.child(m.tokens, "w", "decode") is not m.child(m.engine_seconds, "w", "decode")
    m.child(m.tokens, "w", "decode").inc(5)
    assert 'dgr_tokens_total{phase="decode",worker="w"} 5.0' in generate_latest(m.registry).decode()


def test_the_sessions_tracked_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past TRACKED_SESSIONS the session first seen longest ago is dropped (its next token is no sample); a session
    seen again keeps its place."""
    import consumer.metrics as M

    from .test_dashboard import _answer

    monkeypatch.setattr(M, "TRACKED_SESSIONS", 3)
    m = M.Metrics("w")
    for i, s in enumerate(["a", "b", "c", "d"]):
        m.observe_answers([_answer(s, 5, 1)], 1000.0 + i)
    assert list(m._last_token) == ["b", "c", "d"]
    m.observe_answers([_answer("b", 6, 1), _answer("c", 6, 1, finished=True)], 1010.0)
    assert list(m._last_token) == ["b", "d"] and m._last_token["b"] == (6, 1010.0)
    m.observe_answers([_answer("e", 5, 1), _answer("f", 5, 1)], 1011.0)
    assert list(m._last_token) == ["d", "e", "f"]
