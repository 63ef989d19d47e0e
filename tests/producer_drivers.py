"""Both producer drivers behind one synchronous face, so one test body runs against each.

`make_producer(client, **options)` (the `make_producer` fixture of tests/test_producer*.py) returns a
`Producer`, or an `AsyncProducer` on a `redis.asyncio` client to the same server seen through
`SyncOverAsync`: its coroutines run on an event loop in a thread of their own (so its result readers keep
running between calls, as in a service), and every call waits for its answer.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from producer import AsyncProducer, Producer, ProducerCore, ProducerSettings
from tests.test_transport import CommandCounter

T = TypeVar("T")
DRIVERS = ("sync", "async")


def async_client_for(client: redis.Redis) -> aioredis.Redis:
    """A redis.asyncio client to the server `client` talks to (fakeredis: the same FakeServer)."""
    if isinstance(client, fakeredis.FakeRedis):
        server = client.connection_pool.connection_kwargs["server"]
        return fakeredis.FakeAsyncRedis(server=server)
    kw = client.connection_pool.connection_kwargs
    # No retries inside redis-py (redis.asyncio retries 10 times by default, the sync client built from a
    # URL does not): the driver's own ride-through (schemas/retry.py) is what the tests see.
    return aioredis.Redis(host=kw.get("host", "localhost"), port=kw.get("port", 6379), db=kw.get("db", 0),
                          username=kw.get("username"), password=kw.get("password"), retry=Retry(NoBackoff(), 0))


class _Loop:
    """An event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, aw: Awaitable[T], timeout: float = 120.0) -> T:
        async def wrap() -> T:
            return await aw

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class SyncOverAsync:
    """An AsyncProducer with Producer's synchronous methods (the test bodies' face)."""

    def __init__(self, client: redis.Redis, **options: Any) -> None:
        self._loop = _Loop()
        self.client = client  # the synchronous client the test inspects Redis with
        self.aio: AsyncProducer = self._loop.run(self._make(client, options))
        self.core: ProducerCore = self.aio.core
        self.settings: ProducerSettings = self.aio.settings

    @staticmethod
    async def _make(client: redis.Redis, options: dict[str, Any]) -> AsyncProducer:
        if isinstance(client, fakeredis.FakeRedis):
            # fakeredis mishandles a blocking read that is cancelled (as a reader's is when a session
            # joins): poll it instead. Blocking and waking are tested on a real redis-server.
            options = {"read_block_ms": 0, **options}
        return AsyncProducer(async_client_for(client), **options)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.aio, name)
        if name == "generate":
            return self._generate
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            out = attr(*a, **k)  # an AsyncProducer operation returns an awaitable (producer/tracker.py)
            return self._loop.run(out) if inspect.isawaitable(out) else out

        return call

    @property
    def outages(self) -> int:
        return self.aio.outages

    def _generate(self, *args: Any) -> Iterator[int]:
        agen = self.aio.generate(*args)
        try:
            while True:
                try:
                    yield self._loop.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._loop.run(agen.aclose())

    def close(self) -> None:
        self._loop.run(self.aio.aclose())
        self._loop.run(self.aio.client.aclose())
        self._loop.stop()


class AsyncCommandCounter(AbstractContextManager["AsyncCommandCounter"]):
    """CommandCounter for a redis.asyncio client: each command and each pipeline execute is one."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.calls: list[str] = []

    def __enter__(self) -> AsyncCommandCounter:
        orig_exec, orig_pipe = self.client.execute_command, self.client.pipeline

        async def execute_command(*args: Any, **kw: Any) -> Any:
            self.calls.append(str(args[0]).upper())
            return await orig_exec(*args, **kw)

        def pipeline(*args: Any, **kw: Any) -> Any:
            pipe = orig_pipe(*args, **kw)
            orig_execute = pipe.execute

            async def execute(*a: Any, **k: Any) -> Any:
                names = ",".join(str(c[0][0]).upper() for c in pipe.command_stack)
                self.calls.append(f"PIPELINE[{names}]")
                return await orig_execute(*a, **k)

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        self.client.execute_command = execute_command  # type: ignore[method-assign]
        self.client.pipeline = pipeline  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.client.execute_command
        del self.client.pipeline


def counting_calls(p: Producer | SyncOverAsync) -> CommandCounter | AsyncCommandCounter:
    """Count the round trips the driver itself makes."""
    return AsyncCommandCounter(p.aio.client) if isinstance(p, SyncOverAsync) else CommandCounter(p.client)


MakeProducer = Callable[..., Any]


@pytest.fixture(params=DRIVERS)
def make_producer(request: pytest.FixtureRequest) -> Iterator[MakeProducer]:
    """Builds the driver under test: `make_producer(client, **Producer options)`."""
    made: list[SyncOverAsync] = []

    def make(client: redis.Redis, **options: Any) -> Producer | SyncOverAsync:
        if request.param == "sync":
            return Producer(client, **options)
        p = SyncOverAsync(client, **options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
