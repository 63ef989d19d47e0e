"""A request's watch on its client, and the event stream sent under it.

uvicorn tells an app that its client went away only by an `http.disconnect` from `receive()` (its `send()` to a
closed connection returns quietly), so something must wait on `receive()` while a request waits on its sessions.
Starlette's StreamingResponse does it with an anyio task group of two tasks (the body's and the listener) and
their cancel scopes, and `until_disconnected` did it with two more tasks and an `asyncio.wait` before the
response: per request, that work sat on the path of every request's first token (64 requests at once: each
waits for the ones before it). Here ONE task per request listens, from the request's first wait to its answer's
end, and cancels the request's own task when the client goes; the body is sent from that task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientWatch:
    """Listens for the client's disconnect (the request's body already read: `receive()` can only answer that);
    while the request's task waits in `until_gone`, the disconnect cancels that wait (only then: a cancel is not
    taken back in Python 3.11, so it is never left pending for a later await to meet)."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task, self.gone, self._waiting = task, False, False
        self._listening: asyncio.Task[None] | None = asyncio.ensure_future(self._listen(receive))

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._waiting:
            self.task.cancel()

    async def until_gone(self, work: Awaitable[T]) -> T:
        """`work`'s result (awaited in this task), unless the client goes first: ClientDisconnect."""
        if self.gone:
            close = getattr(work, "close", None)
            if close is not None:  # a coroutine never awaited
                close()
            raise ClientDisconnect()
        self._waiting = True
        try:
            return await work
        except asyncio.CancelledError:
            if self.gone and self.task.uncancel() == 0:  # this watch's cancel, and nobody else's
                raise ClientDisconnect() from None
            raise
        finally:
            self._waiting = False

    def close(self) -> None:
        """Stop listening. The listener, cancelled, keeps its CancelledError, whose traceback holds its frame and
        so this watch: not holding the listener back leaves no cycle for the garbage collector per request."""
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None


DONE = b"data: [DONE]\n\n"  # OpenAI's last event of a stream


class EventStream(StreamingResponse):
    """Server-sent events from the request's own task, under its ClientWatch (closed when the stream ends): the
    client gone, the body's iterator is cancelled where it waits (its `finally` cancels the sessions) and the
    stream ends quietly, as Starlette's does. `ending`: what ends the sessions when the body never ran (a client
    gone between the first token and the stream's start: an async generator not started runs no `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], watch: ClientWatch, ending: Callable[[], Awaitable[object]]
                 ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.events, self.watch, self.ending = content, watch, ending

    async def stream_response(self, send: Send) -> None:
        """Starlette's, but the chunk that ends with DONE ends the body (one send less a request: each passes
        Starlette's send wrappers and is a write of its own); the iterator is still run to its end."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.events:
            if not ended:
                ended = chunk.endswith(DONE)
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.watch.until_gone(self.stream_response(send))
        except ClientDisconnect:
            pass
        finally:
            self.watch.close()
            await self.ending()  # nothing left to do once the body ran to its end or through its `finally`
