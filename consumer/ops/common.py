"""What every ops module shares: the Redis client, the ops key names, small decoding helpers.

Every client here is built by `connect()`, through consumer/connect.py (`redis.Redis.from_url`, or
its `FailoverCluster`), so AUTH/ACL users (`redis://user:pass@host`) and TLS (`rediss://`) come
from the URL alone.

Key names, the control plane's included, are built in `schemas/keys.py` (`OpsKeys` and `LEDGER_*`
here are those names, re-exported): the per-worker ones carry the worker's hash tag, so every script
stays in one Cluster slot.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import redis
from redis.cluster import RedisCluster

from schemas.keys import LEDGER_INDEX as LEDGER_INDEX  # re-exported: the ops modules import key names from here
from schemas.keys import LEDGER_TAG as LEDGER_TAG
from schemas.keys import WORKERS_INDEX, WorkerKeys
from schemas.keys import ledger_key as ledger_key

Client: TypeAlias = "redis.Redis | RedisCluster"

@dataclass(frozen=True, slots=True)
class OpsKeys:
    """Per-worker keys the control plane writes; the names live in schemas/keys.py (`WorkerKeys`)."""

    worker_id: str

    @property
    def worker(self) -> WorkerKeys:
        return WorkerKeys(self.worker_id)

    @property
    def dlq_audit(self) -> str:
        return self.worker.dlq_audit

    def dlq_replayed(self, dlq_id: str) -> str:
        return self.worker.dlq_replayed(dlq_id)

    @property
    def session_pattern(self) -> str:
        return self.worker.session_account_pattern

    def session_id_of(self, session_key: str) -> str:
        return self.worker.session_id_of(session_key)


def connect(url: str, *, cluster: bool = False, decode: bool = False) -> Client:
    """A client from a URL only (AUTH, ACL user, TLS, db all come from it), built by consumer/connect.py
    as every other (a Cluster's is its `FailoverCluster`)."""
    from ..connect import RedisTarget
    from ..connect import connect as connect_target

    return connect_target(RedisTarget(url=url, cluster=cluster), decode=decode)


def operator() -> str:
    """Who runs an ops action, for audit records: DGR_OPS_WHO, else user@host."""
    who = os.environ.get("DGR_OPS_WHO")
    if who:
        return who
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or "unknown"
    return f"{user}@{socket.gethostname()}"


def s(x: object) -> str:
    """bytes or str (either client mode) -> str."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "replace")
    return str(x)


def sdict(m: Mapping[Any, Any] | None) -> dict[str, str]:
    return {s(k): s(v) for k, v in (m or {}).items()}


def r(x: Any) -> Any:
    """redis-py annotates replies as `Awaitable | Any`; this client is synchronous."""
    return x


def workers(client: Client, only: Iterable[str] | None = None) -> list[str]:
    """Worker ids from WORKERS_INDEX (sorted), or `only` when given."""
    if only:
        return list(dict.fromkeys(only))
    return sorted(s(w) for w in cast(set[Any], r(client.smembers(WORKERS_INDEX))))


def scan_worker(client: Client, worker_id: str, match: str, count: int = 500,
                type_: str | None = None) -> Iterator[str]:
    """SCAN for one worker's keys: on a Cluster only the node that holds the worker's slot."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(WorkerKeys(worker_id).base)
        it = client.scan_iter(match=match, count=count, _type=type_, target_nodes=node)
    else:
        it = client.scan_iter(match=match, count=count, _type=type_)
    seen: set[str] = set()
    for k in it:
        name = s(k)
        if name not in seen:  # SCAN may return a key more than once
            seen.add(name)
            yield name


def redis_time_ms(client: Client) -> int:
    """The server's clock (stream ids use it), in ms."""
    sec, usec = cast(tuple[int, int], r(client.time()))
    return int(sec) * 1000 + int(usec) // 1000


def stream_id_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def load_script(client: Client, source: str) -> Any:
    """register_script works the same on Redis and RedisCluster (EVALSHA, NOSCRIPT -> EVAL)."""
    return client.register_script(source)
