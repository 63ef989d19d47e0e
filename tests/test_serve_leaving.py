"""A client may leave at any point of its request: before its first token, between it and the stream's start,
mid-stream, or never. Whatever the point, `dgr serve`'s app ends the request's sessions (their answers closed, or
run to their end), never raises out of the ASGI call, and sends a well-formed answer (its start first, nothing
after the body's end). A search over the point a client leaves at, by hypothesis, against the app in-process: the
producer's answers are a stub that counts how they ended (the fleet is a real tiny-model worker's). It fails when
the sessions' answers are not closed on leaving (gateway/runner.py). Two guards of gateway/watch.py are not
reached from here: a disconnect seen while the request waits nowhere (the watch listens only while the request
waits or streams, with no await between) and a client gone before the stream's start; tests/test_client_watch.py
drives each directly."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgrtools.bench.serve_app import StubAnswers, asgi_scope
from dgrtools.localredis import LocalRedis
from dgrtools.process import ConsumerProcess
from gateway.app import ServeConfig, make_app
from gateway.text import TextModel
from producer import Producer

WORKER = "w-leave"


@pytest.fixture(scope="module")
def fleet(redis_server: LocalRedis, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, list[Any]]]:
    redis.Redis.from_url(redis_server.url).flushall()
    with ConsumerProcess(redis_server.url, WORKER, tiny_model_path, tmp_path_factory.mktemp("leave"), slots=2):
        yield redis_server.url, Producer(redis.Redis.from_url(redis_server.url)).workers()


def _request(url: str, fleet: list[Any], model: TextModel, stream: bool, tokens: int, n: int, leave_after: int | None,
             slow_send: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """One request; the client leaves `leave_after` loop turns after its body is read (None: never). `slow_send`: each
    send waits a loop turn (a transport paused for flow control). What the answers' log says is read before the
    event loop ends (which would close any generator left open)."""
    body = json.dumps({"model": "tiny", "prompt": [1, 5, 9], "max_tokens": tokens, "n": n, "stream": stream,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    log: list[str] = []

    async def go() -> tuple[list[dict[str, Any]], list[str]]:
        app = make_app(ServeConfig(redis_url=url, models=[model]))
        async with app.router.lifespan_context(app):
            producer = app.state.gateway.runner.producer

            async def fleet_now() -> list[Any]:
                return fleet

            producer.fleet_now = fleet_now
            producer.stream_many = lambda sessions, *a, **k: StubAnswers(sessions, tokens, log)
            gone, read, sent = asyncio.Event(), [False], []
            leaving: list[asyncio.Future[None]] = []  # held: the loop keeps only a weak reference to a task

            async def leave() -> None:
                for _ in range(leave_after or 0):
                    await asyncio.sleep(0)
                gone.set()

            async def receive() -> dict[str, Any]:
                if not read[0]:
                    read[0] = True
                    if leave_after is not None:
                        leaving.append(asyncio.ensure_future(leave()))
                    return {"type": "http.request", "body": body, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)
                if slow_send:
                    await asyncio.sleep(0)

            await app(asgi_scope(body), receive, send)  # never raises, whenever the client leaves
            for _ in range(5):  # cancels sent from tasks of their own, if any
                await asyncio.sleep(0)
            return sent, list(log)

    return asyncio.run(go())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=st.booleans(), tokens=st.integers(1, 6), n=st.integers(1, 2),
       leave_after=st.none() | st.integers(0, 40), slow_send=st.booleans())
def test_wherever_a_client_leaves_its_sessions_end(fleet: tuple[str, list[Any]], tiny_model_path: Path,
                                                   stream: bool, tokens: int, n: int, leave_after: int | None,
                                                   slow_send: bool) -> None:
    url, workers = fleet
    sent, log = _request(url, workers, _model(tiny_model_path), stream, tokens, n, leave_after, slow_send)
    assert len(log) == 1, log  # the answers ran to their end or were closed: never left open, never both
    if leave_after is None:
        assert log == ["ran to its end"]
    if sent:
        assert sent[0]["type"] == "http.response.start"
        ends = [i for i, m in enumerate(sent) if m["type"] == "http.response.body" and not m.get("more_body")]
        assert ends in ([], [len(sent) - 1]), sent  # nothing after the body's end
        if sent[0]["status"] == 200 and stream and log == ["ran to its end"] and leave_after is None:
            assert ends and sent[-1]["body"].endswith(b"data: [DONE]\n\n")


_MODELS: dict[Path, TextModel] = {}


def _model(path: Path) -> TextModel:
    if path not in _MODELS:
        _MODELS[path] = TextModel.load("tiny", path)
    return _MODELS[path]
