"""A server that answers every POST at once with a stream of N server-sent events and closes: the floor of what
`dgr bench serve`'s HTTP client measures (its own parsing, its connections, the loopback), with no server work
behind it. 64 streams through httpx reached their first event after 37-41 ms (median) against a Starlette app
that answers at once: a time to first token that is the client's, not the gateway's (docs/benchmarks.md, issue
34). Plain asyncio, no web framework: what it costs is the floor's, not a server's.

    python -m dgrtools.bench.null_http PORT EVENTS
"""

from __future__ import annotations

import asyncio
import sys

__all__ = ["answer", "main"]

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\nconnection: close\r\n\r\n"
_EVENT = b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
_DONE = b"data: [DONE]\n\n"


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, events: int) -> None:
    """Read one request (its head, then Content-Length bytes), stream `events` events and [DONE], close."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        if length:
            await reader.readexactly(length)
        writer.write(_HEAD + _EVENT)  # the first event goes with the head, as a server's first token would
        await writer.drain()
        for _ in range(events - 1):
            writer.write(_EVENT)
        writer.write(_DONE)
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def _serve(port: int, events: int) -> None:
    server = await asyncio.start_server(lambda r, w: answer(r, w, events), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    asyncio.run(_serve(int(args[0]), max(1, int(args[1]))))


if __name__ == "__main__":
    main()
