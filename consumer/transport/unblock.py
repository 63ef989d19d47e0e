"""A stop that does not wait for Redis: requests still in flight `STOP_GRACE_S` after a stop request are
cut off (their sockets shut down), whichever thread sent them.

A request to a Redis that hangs (a paused server, a network that drops packets, a master whose host
died without a reset) blocks on its socket for up to the client's socket timeout (30 s for `dgr
consumer`), and the outage policy's stop check (`RedisIO.io`) only runs between tries. So once a stop is
requested, a watcher thread looks at the requests `RedisIO.io` has in flight; one that started more than
`STOP_GRACE_S` before (or before the stop) has its connection's socket shut down: the blocked read
returns, redis-py raises a ConnectionError, and the outage policy, seeing the stop, raises `Stopping`.
The worker then stops as when Redis is unreachable: what it read stays pending for recovery, its lease
lapses. On a healthy Redis every request the stop path makes (the last completion, the heartbeat, the
lease's release) returns in milliseconds, far inside the grace, and is never cut off. (A blocking read
is served in slices of at most `READ_SLICE_MS` by the intake, so it never needs cutting off.)
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from redis.cluster import RedisCluster

__all__ = ["READ_SLICE_MS", "STOP_GRACE_S", "InFlight"]

STOP_GRACE_S = 0.5
READ_SLICE_MS = 250  # the longest BLOCK of one read: a stop is seen between slices
WATCH_S = 30.0  # how long after a stop the watcher runs (the process has exited long before)
log = logging.getLogger("dgr.transport")


def _pools(client: Any) -> list[Any]:
    if isinstance(client, RedisCluster):
        return [n.redis_connection.connection_pool for n in client.get_nodes() if n.redis_connection is not None]
    pool = getattr(client, "connection_pool", None)
    return [] if pool is None else [pool]


def cut_off(client: Any) -> int:
    """Shut down the socket of every connection of `client` in use (by any thread): the request on it
    fails with a ConnectionError at once. Only the socket: redis-py's connection, its parser and the pool
    are left to the thread that uses them, which cleans them up as after any lost connection."""
    n = 0
    for pool in _pools(client):
        for conn in list(getattr(pool, "_in_use_connections", ())):
            sock = getattr(conn, "_sock", None)
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass
    return n


class InFlight:
    """The requests `RedisIO.io` has in flight, by thread, and the watcher a stop starts."""

    def __init__(self, client_of: Any, who: str) -> None:
        self._client_of = client_of  # () -> the client now (tests swap it)
        self._who = who
        self.started: dict[int, float] = {}  # thread id -> time.monotonic() when its request was sent
        self._watcher: threading.Thread | None = None

    def stop_requested(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(time.monotonic(),), daemon=True,
                                             name=f"dgr-stop-{self._who}")
            self._watcher.start()

    def _watch(self, stopped: float) -> None:
        cut: set[float] = set()
        while time.monotonic() - stopped < WATCH_S:
            time.sleep(0.05)
            now = time.monotonic()
            for started in list(self.started.values()):
                if started not in cut and now - max(started, stopped) > STOP_GRACE_S:
                    cut.add(started)
                    n = cut_off(self._client_of())
                    log.warning("a redis request was still in flight after the stop: cut off", extra={
                        "who": self._who, "in_flight_s": round(now - started, 2), "connections": n})
