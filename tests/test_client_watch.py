"""gateway/watch.py's ClientWatch on its own: a disconnect while the request waits is ClientDisconnect there (and
only there), a cancel from elsewhere stays a cancel, and a request that ends leaves no garbage cycle behind (the
collector would pass over the cancelled listener of every request)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from gateway.watch import ClientWatch


def _receiver() -> tuple[Callable[[], Awaitable[dict[str, Any]]], asyncio.Event]:
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive, gone


def test_a_disconnect_ends_the_wait_as_client_disconnect() -> None:
    async def main() -> None:
        receive, gone = _receiver()
        watch = ClientWatch(receive)
        asyncio.get_running_loop().call_later(0.01, gone.set)
        with pytest.raises(ClientDisconnect):
            await watch.until_gone(asyncio.sleep(30))
        assert watch.gone
        with pytest.raises(ClientDisconnect):  # gone before the next wait: refused without waiting
            await watch.until_gone(asyncio.sleep(30))
        watch.close()
        await asyncio.sleep(0)  # no cancel left pending for this task

    asyncio.run(main())


def test_a_disconnect_between_waits_cancels_nothing() -> None:
    async def main() -> None:
        receive, gone = _receiver()
        watch = ClientWatch(receive)
        assert await watch.until_gone(asyncio.sleep(0, "first")) == "first"
        gone.set()
        await asyncio.sleep(0.01)  # the listener sees it while this task does other work
        await asyncio.sleep(0.01)  # ... and that work is not cancelled
        assert watch.gone
        watch.close()

    asyncio.run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def main() -> None:
        receive, _ = _receiver()

        async def request() -> None:
            watch = ClientWatch(receive)
            try:
                await watch.until_gone(asyncio.sleep(30))
            finally:
                watch.close()

        task = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_requests_leave_no_garbage_cycles() -> None:
    async def main() -> int:
        receive, _ = _receiver()

        async def request() -> None:
            watch = ClientWatch(receive)
            await watch.until_gone(asyncio.sleep(0))
            watch.close()

        await request()
        await asyncio.sleep(0)
        gc.collect()
        for _ in range(50):
            await request()
        await asyncio.sleep(0)  # the listeners' cancels delivered
        return gc.collect()

    gc.disable()
    try:
        assert asyncio.run(main()) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("gone_at", ["never", "before the stream", "mid-stream"])
def test_an_event_stream_ends_its_sessions_however_the_client_goes(gone_at: str) -> None:
    """EventStream: the body sent whole (ended by its last event's send), or cut where it waits when the client
    goes; `ending` (the sessions' end) runs every time, also when the body never started (a generator not started
    runs no `finally`)."""
    from gateway.watch import EventStream

    async def main() -> tuple[list[bytes], list[str]]:
        receive, gone = _receiver()
        log: list[str] = []
        sent: list[bytes] = []

        async def body() -> Any:
            log.append("started")
            try:
                yield b"data: 1\n\n"
                if gone_at == "mid-stream":
                    gone.set()
                    await asyncio.sleep(30)  # the next event, never come
                yield b"data: [DONE]\n\n"
            finally:
                log.append("body's finally")

        async def ending() -> None:
            log.append("ending")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message.get("body", b"<start>") + (b"" if message.get("more_body", True) else b"<end>"))

        watch = ClientWatch(receive)
        if gone_at == "before the stream":
            gone.set()
            await asyncio.sleep(0.01)
        await EventStream(body(), watch, ending)({"type": "http"}, receive, send)
        return sent, log

    sent, log = asyncio.run(main())
    if gone_at == "never":  # the body ends with its last event, in one send
        assert sent == [b"<start>", b"data: 1\n\n", b"data: [DONE]\n\n<end>"]
        assert log == ["started", "body's finally", "ending"]
    elif gone_at == "before the stream":
        assert sent == [] and log == ["ending"]
    else:
        assert sent == [b"<start>", b"data: 1\n\n"] and log == ["started", "body's finally", "ending"]


def test_an_event_stream_without_its_last_event_still_ends_its_body() -> None:
    """A body that stops before DONE (not the gateway's, whose every path ends with it) is ended by an empty send,
    as Starlette's is; events after DONE are never sent."""
    from gateway.watch import DONE, EventStream

    async def main(chunks: list[bytes]) -> list[tuple[bytes, bool]]:
        receive, _ = _receiver()
        sent: list[tuple[bytes, bool]] = []

        async def body() -> Any:
            for c in chunks:
                yield c

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                sent.append((message["body"], message["more_body"]))

        async def ending() -> None:
            pass

        await EventStream(body(), ClientWatch(receive), ending)({"type": "http"}, receive, send)
        return sent

    assert asyncio.run(main([b"data: 1\n\n"])) == [(b"data: 1\n\n", True), (b"", False)]
    assert asyncio.run(main([b"data: 1\n\n" + DONE, b"data: 2\n\n"])) == [(b"data: 1\n\n" + DONE, False)]
