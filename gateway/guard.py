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

- **max_connections**: connections past this many open are answered 503 and closed at once, so that a flood of
  them never takes the descriptors the process needs for its own Redis connections (a gateway out of
  descriptors cannot open one: every request fails); by default the process's descriptor limit less
  RESERVED_FDS;

and the app reads a request's body within **body_timeout_s** (gateway/app.py: 408 in OpenAI's shape).

The hooks are uvicorn's protocol methods (connection_made, data_received, on_response_complete, httptools'
on_message_begin / on_url / on_header, send_400_response) and its `cycle`, `loop` and `connections`: not a public
API, so tests/test_serve_clients.py drives every bound through a started server on the uvicorn installed.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["RESERVED_FDS", "ClientBounds", "guarded_protocol"]

RESERVED_FDS = 256  # descriptors kept from clients: the producer's Redis connections, the model files, logs


@dataclass(frozen=True)
class ClientBounds:
    head_timeout_s: float = 10.0
    max_head_bytes: int = 64 << 10
    body_timeout_s: float = 30.0
    write_timeout_s: float = 60.0
    max_connections: int | None = None  # None: the descriptor limit less RESERVED_FDS (at least 64)

    def connection_cap(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return max(64, (1 << 20 if soft == resource.RLIM_INFINITY else soft) - RESERVED_FDS)

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be >= 1024, got {self.max_head_bytes}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


class _HeadTooLarge(Exception):
    """Raised in the parser's callback: httptools stops and uvicorn answers 400, which _Guarded makes a 431."""


# status -> its status line's text and any header it adds
_STATUS = {408: (b"Request Timeout", b""), 431: (b"Request Header Fields Too Large", b""),
           503: (b"Service Unavailable", b"retry-after: 1\r\n")}


class _Guarded(AutoHTTPProtocol):  # type: ignore[misc, valid-type]  # uvicorn's class, chosen at import
    bounds: ClassVar[ClientBounds] = ClientBounds()
    cap: ClassVar[int] = 0  # bounds.connection_cap(), once per class
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
        if len(self.connections) > self.cap:  # uvicorn's set of this server's open connections, this one in it
            self._refuse(503, "too many connections; retry later")
            return
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
        _cancel(self._head_timer)
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
        """Answer `status` (a plain-text body saying why) and close: said before any request was read, or instead
        of the one that broke a bound, so nothing more is read from this connection."""
        reason, headers = _STATUS[status]
        body = message.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\n%scontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, reason, headers, len(body), body))
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
        _cancel(self._write_timer)
        self._write_timer = None

    def _write_timeout(self) -> None:
        self._write_timer = None
        self.transport.abort()  # close() would wait to send what the client does not read


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def guarded_protocol(bounds: ClientBounds) -> type[asyncio.Protocol]:
    """uvicorn's protocol class (httptools when installed, else h11) bounded by `bounds`; pass it as `http=`."""
    return type("GuardedHTTPProtocol", (_Guarded,), {"bounds": bounds, "cap": bounds.connection_cap()})
