"""Requests on a connection the sending thread keeps, without redis-py's wrapper of each request: the worker's
read ahead and scripts (consumer/transport/connection.py) and the synchronous Tracker's result reads and pushes
(producer/tracker.py), the requests each side makes every fused call; and the stream reads' commands and raw
replies, written once for both. `schemas/__init__` does not import it (a part that loads schemas loads no Redis)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import redis

__all__ = ["Direct", "serving", "stream_pairs", "xread_command"]


class Direct:
    """Requests sent on a connection of the client's own pool that the calling thread keeps from one request to
    the next, their replies as the parser reads them: without redis-py's wrapper of each request (the pool's
    get and release, its retry, its event and observability hooks), about a third of a round trip's CPU here
    (an EVALSHA of 20 keys and 15 arguments: 270 -> 172 us, a /tmp script, docs/benchmarks.md, issue 32). No response
    callback runs: a stream read's entries come as flat lists (schemas/replies.py reads both). An error reply is
    its exception in its place; any other error drops the connection (the next request takes one from the pool)
    and is raised, for `RedisIO.io` to ride through. A kept connection stays in the pool's in-use set, where a
    stop that cannot wait for Redis cuts it off (consumer/transport/unblock.py), and goes back to the pool when its
    thread ends or this object is dropped (`_Held`: a worker that crashed in a test, and its transport, hold none)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._pool = client.connection_pool
        self._local = threading.local()

    @classmethod
    def of(cls, client: Any) -> Direct | None:
        """A sender for a `redis.Redis` (a Sentinel's included), else None: a cluster client routes each request
        by its keys, and a wrapper of a client (the tests' fault injectors) is asked as it is."""
        return cls(client) if isinstance(client, redis.Redis) else None

    def __call__(self, *commands: tuple[Any, ...]) -> list[Any]:
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = _Held(self._pool)
        conn = held.conn
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            out: list[Any] = []
            for _ in commands:
                try:
                    out.append(conn.read_response())
                except redis.ResponseError as e:
                    out.append(e)
            return out
        except BaseException:
            # dropped, and back to the pool: the next request takes one from it, which connects as the pool
            # connects (a Sentinel pool asks the sentinels for the master: a send on a dropped connection would
            # reconnect to the address it had, a master gone for good)
            self._local.held = None
            conn.disconnect()
            held.release()
            raise


class _Held:
    """One thread's kept connection, handed back to its pool once: by `release()`, or when the holder goes (its
    thread ended, or the Direct's thread-local storage went with it)."""

    __slots__ = ("__weakref__", "conn", "release")

    def __init__(self, pool: Any) -> None:
        self.conn = pool.get_connection()
        self.release = weakref.finalize(self, pool.release, self.conn)


def serving(direct: Direct | None, client: Any) -> Direct | None:
    """`direct` while it is the sender of `client`, the client in use (tests put another in a transport's place)."""
    return direct if direct is not None and direct.client is client else None


def xread_command(streams: Mapping[str, str], count: int | None, *, block_ms: int | None = None,
                  group: tuple[str, str] | None = None) -> tuple[Any, ...]:
    """XREAD (or XREADGROUP for `group` = (group, consumer)) of `streams` (stream -> the id to read after), as
    redis-py's xread and xreadgroup write it."""
    head: tuple[Any, ...] = ("XREAD",) if group is None else ("XREADGROUP", "GROUP", *group)
    opts: tuple[Any, ...] = (("COUNT", count) if count is not None else ()) + (("BLOCK", block_ms) if block_ms else ())
    return (*head, *opts, "STREAMS", *streams, *streams.values())


def stream_pairs(raw: Any) -> list[tuple[Any, Any]]:
    """A stream read's raw reply (no response callback) as RESP2's list of (stream, entries), whatever the protocol:
    RESP3 gives a map of streams; nothing read, None. Each entry stays [id, flat fields]."""
    if not raw:
        return []
    return list(raw.items()) if isinstance(raw, dict) else [tuple(p) for p in raw]
