"""What a client may hold of `dgr serve` without sending a request, and how long it may stall one.

uvicorn bounds none of it: a connection that sends nothing, or a request's head one byte at a time, or a body
that never ends, is kept open for as long as the client likes (its keep-alive timeout is armed only after a
response), and under httptools (uvloop's parser, the serve extra) a request's head grows without limit: its URL and
headers are kept in memory as they arrive (20 MB of headers taken here, measured). So a few thousand sockets that
trickle bytes hold every descriptor the process has, and one client can make it buffer gigabytes. llama-server's
HTTP library closes a connection whose read or write stalls past its timeout; nginx bounds a request's head by
time (client_header_timeout) and size (large_client_header_buffers).

`guarded_protocol(bounds)` is uvicorn's own protocol class (the one `http="auto"` picks) with the bounds added:

- **head_timeout_s**: a request's head (request line and headers) must be complete this long after the connection
  opens or its last answer ends; else the connection is closed (a 408 first when part of a head came);
- **max_head_bytes**: a head larger than this is answered 431 and the connection closed (under h11, whose own
  bound is set to it, 400);
- **write_timeout_s**: a client that stops reading an answer (its socket's buffers full, the transport paused)
  for this long is dropped: the request ends as a disconnect does, cancelling its sessions;

and the app reads a request's body within **body_timeout_s** (gateway/app.py: 408 in OpenAI's shape).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["ClientBounds", "guarded_protocol"]


@dataclass(frozen=True)
class ClientBounds:
    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 << 10
    body_timeout_s: float = 30.0
    write_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")


class _HeadTooLarge(Exception):
    """Raised in the parser's callback: httptools stops and uvicorn answers 400, which _Guarded makes a 431."""


_STATUS = {408: b"408 Request Timeout", 431: b"431 Request Header Fields Too Large"}


class _Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # uvicorn's class, chosen at import
    bounds: ClassVar[ClientBounds] = ClientBounds()
    # set in connection_made, before any other callback of the connection
    _head_timer: asyncio.TimerHandle | None
    _write_timer: asyncio.TimerHandle | None
    _head_bytes: int
    _head_heard: bool
    _over: bool

    def connection_made(self, transport: Any) -> None:
        self._head_timer = self._write_timer = None
        self._head_bytes, self._head_heard, self._over = 0, False, False
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        self._disarm_write()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete

    # -- the head's deadline: armed while the connection holds no request in progress
    def _arm_head(self) -> None:
        self._disarm_head()
        self._head_heard = False
        self._head_timer = self.loop.call_later(self.bounds.head_timeout_s, self._head_timeout)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._in_request() or self.transport.is_closing():
            return
        if self._head_heard:  # part of a head came: say why it is closed; an idle connection is just closed
            self._refuse(408, "the request's head did not arrive in time")
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self._head_heard = True
        super().data_received(data)
        if self._in_request():
            self._disarm_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._in_request():
            self._arm_head()

    # -- the head's size (httptools' callbacks; h11 bounds it itself)
    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.bounds.max_head_bytes:
            self._over = True
            raise _HeadTooLarge  # before the parser keeps it

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # ": " and CRLF: a flood of empty headers is counted too
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        if self._over:
            self._refuse(431, f"the request's head is over {self.bounds.max_head_bytes} bytes")
        else:
            super().send_400_response(msg)

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode()
        self.transport.write(b"HTTP/1.1 " + _STATUS[status] + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()

    # -- a reader that stalls: the transport's buffer stays over its high-water mark
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.bounds.write_timeout_s, self._write_timeout)

    def resume_writing(self) -> None:
        self._disarm_write()
        super().resume_writing()

    def _disarm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timeout(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait to send what the client does not read


def guarded_protocol(bounds: ClientBounds) -> type[asyncio.Protocol]:
    """uvicorn's protocol class (httptools when installed, else h11) bounded by `bounds`; pass it as `http=`."""
    return type("GuardedHTTPProtocol", (_Guarded,), {"bounds": bounds})
