"""Replies the worker never gets: Redis ran the command and answered, and the connection dropped before the answer
was read (a reset, a restart, a failover). Every call is retried through it (consumer/transport/connection.py
`RedisIO.io`), and a retried XREADGROUP `>` returns the entries after those the lost reply carried: they sit in
this consumer's pending list, delivered and unheld. Handed out only by the next ownership sweep, after the newer
ones, a session's later step came before its earlier one: a continuation pushed ahead was refused position_gap
(the session ended for its caller), a prompt's later chunk was answered state_lost (a session replayed that was
never lost). A read that rode through a failure now hands out those entries first (consumer/transport/intake.py).

On a real redis-server: the worker's connections lose replies at random after its start, and the Tracker's too
in some runs.
Every session ends with its solo tokens, on its first attempt (nothing replayed), every entry acked.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from consumer.config import TransportSettings
from consumer.engines.reference import NumpyReferenceEngine
from consumer.transport import RedisTransport
from consumer.worker import Worker, WorkerSettings
from producer import Producer
from schemas import GROUP

from .chaos_support import SOAK, check_exact, specs_for
from .connection_hooks import hook_connections
from .support import prompts
from .test_delivery import Stepper

WID = "w-lost"


class _Losses:
    def __init__(self, seed: int) -> None:
        self.rng, self.rate, self.lost = random.Random(seed), 0.0, 0


def lossy_client(url: str, losses: _Losses) -> redis.Redis:
    """A client whose connections, at random, send a request (a command, a pipeline, a script) and then lose its
    reply with the connection, after Redis ran it: what a reset between Redis' answer and its read leaves. Every
    connection of its pool, so the kept one (schemas/direct.py) too."""
    doomed: set[int] = set()  # connections whose request's reply is to be lost

    def send(conn: Any) -> None:
        if losses.rng.random() < losses.rate:
            doomed.add(id(conn))

    def read(conn: Any) -> None:
        if id(conn) in doomed:
            doomed.discard(id(conn))
            losses.lost += 1
            conn.disconnect()
            raise redis.ConnectionError("injected: the reply was lost")

    return hook_connections(redis.Redis.from_url(url), before_send=send, after_read=read)


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[NumpyReferenceEngine]:
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=256)
    yield eng
    eng.close()


@settings(max_examples=60 if SOAK else 4, deadline=None, derandomize=not SOAK, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rate=st.sampled_from([0.05, 0.15, 0.3]), decode_n=st.sampled_from([1, 3, 16]),
       chunk=st.sampled_from([4, 16]), tracker_too=st.booleans())
@example(seed=8, rate=0.3, decode_n=1, chunk=4, tracker_too=False)  # chunks of 4: many steps a session
@example(seed=4, rate=0.15, decode_n=1, chunk=4, tracker_too=False)  # stop 64's tree: position_gap in 4 runs of 4
def test_lost_replies_neither_end_nor_replay_a_session(real_redis: redis.Redis, engine: NumpyReferenceEngine,
                                                       tiny_model_path: Path, seed: int, rate: float, decode_n: int,
                                                       chunk: int, tracker_too: bool) -> None:
    """`tracker_too`: the Tracker's connections lose replies as well (its pushes sent again: twins)."""
    real_redis.flushall()
    url = "redis://{host}:{port}/0".format(**real_redis.connection_pool.connection_kwargs)
    losses = _Losses(seed)
    transport = RedisTransport(lossy_client(url, losses), WID, consumer_name=WID,
                               settings=TransportSettings(retry_base_s=0.0005, retry_cap_s=0.002))
    worker = Worker(engine, transport,  # type: ignore[arg-type]
                    WorkerSettings(worker_id=WID, block_ms=0, gather_ms=0.0, await_ms=0, heartbeat_s=0.0,
                                   recover_every_s=3600.0))
    worker.start()
    losses.rate = rate  # after the start: its reads of pending entries are the start's, tested elsewhere
    tracker_losses = _Losses(seed + 1)
    producer = Producer(lossy_client(url, tracker_losses) if tracker_too else real_redis, prefill_chunk=chunk,
                        decode_n=decode_n)
    tracker_losses.rate = rate
    specs = specs_for(real_redis, WID, f"lost{seed}", prompts(3, 300, seed=seed, lo=6, hi=30), 8)
    stepper = Stepper(producer, worker)
    for spec, prompt in specs:
        stepper.handles[spec.session_id] = producer.open(spec, prompt)
    stepper.run()
    assert losses.lost > 0
    check_exact(real_redis, WID, specs, stepper.handles, tiny_model_path)
    assert {h.session_id: h.attempt for h in stepper.handles.values()} == dict.fromkeys(stepper.handles, 0)
    for stream in transport.intake.streams:
        assert real_redis.xpending(stream, GROUP)["pending"] == 0, stream
