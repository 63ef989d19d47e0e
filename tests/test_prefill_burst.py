"""The prefill burst: while no session decodes, a prefill call takes up to `prefill_burst` tokens (the
engine's efficient call, llama-server's 2,048 batch); while any decodes, it stays within `prefill_budget`
and is paced (consumer/sched/pacing.py), so the decode bound of consumer/sched/scheduler.py holds.
Counted in rows per fused call, never timed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.batch import EngineOutput, FusedBatch
from consumer.engines.reference import NumpyReferenceEngine
from consumer.sched.pacing import PrefillPacer
from schemas import Status

from .support import prompts
from .test_worker_inprocess import Driver, make_worker


def test_pacer_bursts_only_while_nothing_decodes() -> None:
    pacer = PrefillPacer(max_tokens=512, ratio=0.8, min_tokens=32, idle_tokens=2048)
    assert pacer.budget(decoding=False) == 2048
    assert pacer.budget(decoding=True) == 512  # nothing learned yet: the configured budget, never the burst
    pacer.observe("decode", 4, 0.05)
    pacer.observe("prefill", 512, 1.5)
    assert 32 <= pacer.budget(decoding=True) < 512  # paced
    assert pacer.budget(decoding=False) == 2048
    assert PrefillPacer(max_tokens=512, ratio=0).budget(decoding=True) == 512  # fixed mode: the budget
    assert PrefillPacer(max_tokens=512, ratio=0, idle_tokens=1024).budget(decoding=False) == 1024
    # a burst below the budget (or 0: off) never shrinks a call
    assert PrefillPacer(max_tokens=512, idle_tokens=0).budget(decoding=False) == 512
    assert PrefillPacer(max_tokens=512, idle_tokens=64).budget(decoding=False) == 512


class Recording:
    """The reference engine, recording each call's phase and rows."""

    def __init__(self, inner: NumpyReferenceEngine) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def forward(self, batch: FusedBatch) -> EngineOutput:
        self.calls.append((batch.phase, len(batch)))
        return self.inner.forward(batch)


@pytest.fixture
def engine(tiny_model_path: Path) -> Iterator[Recording]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=8, ctx_per_session=1024, max_tokens_per_call=200)
    yield Recording(eng)
    eng.close()


def test_a_wave_of_prompts_goes_in_burst_calls_then_paced_calls_while_sessions_decode(
        fake_redis: redis.Redis, engine: Recording) -> None:
    # burst 4096 is capped by the engine's 200 rows per call; the budget is 32
    worker = make_worker(fake_redis, engine, max_batch=8, prefill_budget=32, prefill_burst=4096,
                         w_decode=4, w_prefill=1)
    assert worker.pacer.idle_tokens == 200
    d = Driver(fake_redis, worker)
    wave = prompts(3, 300, seed=5, lo=90, hi=90)
    for i, p in enumerate(wave):
        d.open(f"w-{i}", p, max_tokens=10_000, chunk=64)
    worker.run_once()
    assert engine.calls[0] == ("prefill", 200)  # one call past the budget: nothing decodes yet
    for _ in range(30):
        d.poll()
        worker.run_once()
    d.open("late", prompts(1, 300, seed=6, lo=120, hi=120)[0], max_tokens=1, chunk=64)
    mark = len(engine.calls)
    for _ in range(200):
        if d.done("late"):
            break
        d.poll()
        worker.run_once()
    assert d.done("late") and d.results["late"][-1].status == Status.OK
    later = engine.calls[mark:]
    assert any(p == "decode" for p, _ in later)
    prefill_rows = [n for p, n in later if p == "prefill"]
    assert prefill_rows and max(prefill_rows) <= 32  # sessions decode: the budget holds
    assert sum(prefill_rows) == 120


def test_no_burst_when_set_off(fake_redis: redis.Redis, engine: Recording) -> None:
    worker = make_worker(fake_redis, engine, max_batch=4, prefill_budget=32, prefill_burst=0)
    d = Driver(fake_redis, worker)
    d.open("s", prompts(1, 300, seed=7, lo=90, hi=90)[0], max_tokens=1, chunk=64)
    while not d.done("s"):
        worker.run_once()
        d.poll()
    assert [n for p, n in engine.calls if p == "prefill"] == [32, 32, 26]
