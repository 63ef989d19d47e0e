"""WAIT-based durability (`TransportSettings.durable_replicas`): a completion counts only once that many
replicas have it (docs/failover.md, "Durable completions").

One round trip: a pipeline on ONE connection of the master that holds the worker's keys, EVALSHA of the
completion script then `WAIT n timeout`. WAIT covers every write this connection made so far, so it
covers the script's. When fewer replicas acknowledge within the timeout the completion has not counted
yet: `NotDurable`, which the outage policy (RedisIO.io) rides through like a Redis that cannot serve,
re-sending the call as it is until the replicas have it, a stop is requested (`Stopping`) or the
outage lasts `outage_max_s`. A re-send is exactly-once by the script's call guard: on the master that
has the call it is refused whole ('DUP', nothing written); on a promoted replica that lost it, it is
filed there, once. A 'DUP' writes nothing, so a re-send on a new connection (after a reconnect) makes
one small write of its own (`durable_resends` in the worker hash) before WAIT: WAIT then covers a point
of the replication stream after the first filing, wherever that was sent from.

On a Redis Cluster the pipeline goes to the node that holds the worker's hash slot (redis-py's Cluster
pipeline would send a WAIT to every primary and sum the replies); a MOVED reply or a lost node refreshes
the slot map before the next try.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from .errors import NotDurable

if TYPE_CHECKING:
    from .connection import RedisIO

__all__ = ["DurableScripts"]

RESENDS_FIELD = "durable_resends"  # worker hash: completion calls re-sent to reach the replicas


class DurableScripts:
    """Runs a registered script and waits for the replicas, through outages (`RedisIO.io`)."""

    def __init__(self, io: RedisIO, replicas: int, timeout_ms: int) -> None:
        if replicas < 1 or timeout_ms < 1:
            raise ValueError("durable completions need replicas >= 1 and a timeout >= 1 ms (WAIT 0 waits forever)")
        self.io = io
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self.shortfalls = 0  # sends that fewer replicas acknowledged in time
        self._stale_slots = False

    def _node_client(self) -> Any:
        """The client whose pipeline runs on one connection of the master holding the worker's keys."""
        client = self.io.client
        if not isinstance(client, RedisCluster):
            return client
        if self._stale_slots:
            client.nodes_manager.initialize()
            self._stale_slots = False
        return client.get_redis_connection(client.get_node_from_key(self.io.keys.base))

    def run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """The script's reply, once the replicas have the call: the reply of the send that filed it when
        that came back (a re-send's reply is 'DUP'), else 'DUP'."""
        io = self.io
        io.round_trips += 1
        sha = io.scripts[name].sha
        sends = 0
        filed: list[Any] = []  # the reply of the send that filed the call, when it came back

        def send() -> Any:
            nonlocal sends
            for _ in range(2):  # a second time only after loading the scripts (NOSCRIPT: a restarted Redis)
                sends += 1
                try:
                    pipe = self._node_client().pipeline(transaction=False)
                    pipe.evalsha(sha, len(keys), *keys, *args)
                    if sends > 1:
                        pipe.hincrby(io.keys.worker_account, RESENDS_FIELD, 1)
                    pipe.wait(self.replicas, self.timeout_ms)
                    replies = pipe.execute(raise_on_error=False)
                except (redis.ConnectionError, redis.TimeoutError):
                    self._stale_slots = True
                    raise
                reply, acked = replies[0], replies[-1]
                if isinstance(reply, redis.exceptions.NoScriptError):
                    io.load_scripts()
                    continue
                if isinstance(reply, redis.ResponseError) and str(reply).startswith(("MOVED", "ASK")):
                    self._stale_slots = True  # a Cluster failover moved the slot: ask again where it is
                    raise redis.ConnectionError(f"the worker's slot moved: {reply}")
                if isinstance(reply, Exception):
                    raise reply  # DGRFENCED (the caller's), READONLY (an outage), ...
                if isinstance(acked, Exception):
                    raise acked
                if not filed and not isinstance(reply, bytes | str):
                    filed.append(reply)  # filed by this send ('DUP': by an earlier one)
                if int(acked) < self.replicas:
                    self.shortfalls += 1
                    hook = getattr(io.listener, "durable_shortfall", None)  # the worker's metrics
                    if hook is not None:
                        hook()
                    raise NotDurable(f"{int(acked)} of {self.replicas} replicas acknowledged the completion "
                                     f"within {self.timeout_ms} ms: re-sent until they have it")
                return filed[0] if filed else reply  # a re-send's 'DUP' stands for the filing's reply
            raise redis.ConnectionError("the completion script is not loaded on the master")

        return io.io(send)
