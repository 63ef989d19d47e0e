"""Redis must keep what dgr writes: its `maxmemory-policy` (docs/operations.md, "Redis memory").

dgr's keys are not a cache: the input streams hold jobs not yet answered, the result streams and records hold
answers the Tracker has not read, the session hashes hold the accounting counters, and the lease fences a worker.
Under any policy but `noeviction` a Redis at its `maxmemory` deletes keys to make room (allkeys-*: any key;
volatile-*: keys with a TTL, among them the lease, the heartbeats and the result streams), and nothing tells the
writer: a job or an answer vanishes, a counter restarts from nothing. Under `noeviction` it refuses writes instead
(an OOM reply), which the worker and the Tracker ride through as an outage (schemas/retry.py) until memory is
freed: nothing lost, nothing doubled (tests/test_chaos.py). So a worker refuses to start on a Redis that evicts,
unless told it may (`--allow-eviction`: a Redis with no `maxmemory`, or one the operator watches otherwise).

The policy is read from `INFO memory` (every primary of a Cluster), which managed services that rename CONFIG
still answer; a server that refuses INFO (an ACL without it, a stand-in) cannot be judged: the worker says so
once and starts."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
from redis.cluster import RedisCluster

__all__ = ["KEEPS_EVERYTHING", "evicting", "eviction_policies"]

log = logging.getLogger("dgr.transport")

KEEPS_EVERYTHING = "noeviction"


def eviction_policies(client: Any) -> dict[str, str] | None:
    """node -> its maxmemory_policy as INFO memory says ("" for a single server); None when INFO is refused or
    says nothing of it. Connection errors are the caller's (it rides them through as an outage)."""
    try:
        if isinstance(client, RedisCluster):
            info: Mapping[str, Any] = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        else:
            info = {"": client.info("memory")}
    except redis.ResponseError as e:  # NOPERM, an unknown command
        log.warning("could not read Redis' maxmemory-policy (INFO memory refused: %s); dgr needs 'noeviction' "
                    "(docs/operations.md)", str(e)[:200])
        return None
    out = {node: str(v.get("maxmemory_policy")) for node, v in info.items()
           if isinstance(v, Mapping) and v.get("maxmemory_policy") is not None}
    return out or None


def evicting(policies: Mapping[str, str] | None) -> str | None:
    """What is wrong with `policies` (eviction_policies), as one sentence; None when every node keeps its keys (or
    nothing could be read)."""
    bad = {node: p for node, p in (policies or {}).items() if p != KEEPS_EVERYTHING}
    if not bad:
        return None
    where = ", ".join(f"{p} on {node}" if node else p for node, p in sorted(bad.items()))
    return (f"Redis may evict dgr's keys (maxmemory-policy {where}): jobs, answers, accounting counters and leases "
            f"would vanish at maxmemory. Set `maxmemory-policy {KEEPS_EVERYTHING}` (a full Redis then refuses "
            f"writes, ridden through as an outage), or start with --allow-eviction (docs/operations.md)")
