"""Every Redis call the worker makes rides through a dropped connection, not only the ones a test named.

The worker's Redis client fails commands and pipelines at random (ConnectionError, as a Redis restart
or a reset connection gives), while heartbeats, trims and recovery sweeps run on every iteration. The
loop must never raise, and every session must finish with its solo tokens. Found by the chaos suite:
`RedisTransport.trim()` (run with each heartbeat) was outside the retry and a reset connection during it
killed the worker.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.config import TransportSettings
from consumer.engines.reference import NumpyReferenceEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings

from .connection_hooks import hook_connections
from .support import prompts, solo_generate
from .test_worker_inprocess import WID, Driver


class _Faults:
    def __init__(self, seed: int, rate: float) -> None:
        self.rng, self.rate, self.injected = random.Random(seed), rate, 0

    def maybe_fail(self) -> None:
        if self.rng.random() < self.rate:
            self.injected += 1
            raise redis.ConnectionError("injected: connection reset by peer")


def flaky_client(server: fakeredis.FakeServer, faults: _Faults) -> redis.Redis:
    """A fakeredis client whose commands and pipelines fail at random before reaching the server, and whose
    connections' sends too (the transport's kept connection sends without the client: connection.py Direct)."""

    class FlakyPipeline(fakeredis.FakeRedis().pipeline().__class__):  # type: ignore[misc]
        def execute(self, *a: Any, **k: Any) -> Any:
            faults.maybe_fail()
            return super().execute(*a, **k)

    class Flaky(fakeredis.FakeRedis):
        def execute_command(self, *a: Any, **k: Any) -> Any:
            faults.maybe_fail()
            return super().execute_command(*a, **k)

        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
            return FlakyPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    return hook_connections(Flaky(server=server), before_send=lambda _conn: faults.maybe_fail())


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([0.05, 0.15, 0.3]))
def test_the_worker_rides_through_random_connection_failures(engine: NumpyReferenceEngine, seed: int,
                                                            rate: float) -> None:
    server = fakeredis.FakeServer()
    honest = fakeredis.FakeRedis(server=server)
    faults = _Faults(seed, 0.0)  # no faults while the worker starts (start-up waiting is tested elsewhere)
    transport = RedisTransport(flaky_client(server, faults), WID, consumer_name=WID,
                               settings=TransportSettings(retry_base_s=0.0005, retry_cap_s=0.002))
    worker = Worker(engine, transport,  # type: ignore[arg-type]
                    WorkerSettings(worker_id=WID, block_ms=1, gather_ms=0.0, heartbeat_s=0.0, recover_every_s=0.0))
    worker.start()
    faults.rate = rate
    d = Driver(honest, worker)
    ps = prompts(3, 300, seed=seed)
    for i, p in enumerate(ps):
        d.open(f"s{i}", p, max_tokens=5)
    for _ in range(400):
        worker.run_once()  # must never raise
        d.poll()
        if all(d.done(f"s{i}") for i in range(3)):
            break
    assert faults.injected > 0
    for i, p in enumerate(ps):
        assert d.tokens[f"s{i}"] == solo_generate(engine, p, 5), f"s{i}"
