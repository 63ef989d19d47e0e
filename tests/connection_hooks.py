"""A client whose pool makes connections that call hooks around each request: the fault injectors of
tests/test_transport_faults.py (a send that fails before Redis sees it) and tests/test_lost_replies.py (a reply
lost after Redis ran the request). Every connection of the pool, so the transport's kept one (schemas/direct.py)
too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

__all__ = ["hook_connections"]


def hook_connections(client: redis.Redis, *, before_send: Callable[[Any], None] | None = None,
                     after_read: Callable[[Any], None] | None = None) -> redis.Redis:
    """`before_send(conn)` ahead of every send of a packed request, `after_read(conn)` after every reply read (it
    may raise: the reply is then lost); the client, its pool's connection class replaced."""
    base = client.connection_pool.connection_class

    class Hooked(base):  # type: ignore[misc, valid-type]
        def send_packed_command(self, *a: Any, **k: Any) -> Any:
            if before_send is not None:
                before_send(self)
            return super().send_packed_command(*a, **k)

        def read_response(self, *a: Any, **k: Any) -> Any:
            out = super().read_response(*a, **k)
            if after_read is not None:
                after_read(self)
            return out

    client.connection_pool.connection_class = Hooked
    return client
