"""Requests on a connection the sending thread keeps, without redis-py's wrapper of each request: the worker's
read ahead and scripts (consumer/transport/connection.py) and the Tracker's result reads (producer/tracker.py),
the requests each side makes every fused call. Imported by those two only (schemas itself loads no Redis)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import redis

__all__ = ["Direct"]


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
