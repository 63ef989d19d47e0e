"""The README's asyncio Tracker (examples/sse_tracker.py) streams a session's tokens as server-sent events.
Skipped without the `tracker` extra (aiohttp)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import redis

from producer.aio import AsyncProducer
from tests.producer_drivers import async_client_for
from tests.support import ROOT
from tests.test_producer import FakeWorker, expected_tokens
from tests.test_transport import WORKER

pytest.importorskip("aiohttp")
from aiohttp.test_utils import TestClient, TestServer


def load_example() -> object:
    spec = importlib.util.spec_from_file_location("sse_tracker", ROOT / "examples" / "sse_tracker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sse_example_streams_a_sessions_tokens(real_redis: redis.Redis) -> None:
    example = load_example()

    async def main() -> tuple[list[str], int]:
        client = async_client_for(real_redis)
        producer = AsyncProducer(client, timeout_s=20)
        async with producer, TestClient(TestServer(example.make_app(producer, WORKER))) as http:  # type: ignore[attr-defined]
            resp = await http.get("/generate", params={"prompt": "4,5,6", "max_tokens": "6"})
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = (await resp.text()).strip().split("\n\n")
            bad = await http.get("/generate", params={"prompt": "x"})
        await client.aclose()
        return events, bad.status

    with FakeWorker(real_redis):
        events, bad_status = asyncio.run(main())
    tokens = [int(e.removeprefix("data: ")) for e in events[:-1]]
    (record,) = real_redis.keys(f"dgr:{{{WORKER}}}:sess:sse-*")  # the session the server opened
    sid = record.decode().rsplit(":", 1)[1]
    assert tokens == expected_tokens(sid, 3, 6) and events[-1] == "event: end\ndata: finished"
    assert bad_status == 400
