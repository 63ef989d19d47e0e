"""Where every dgr process gets its Redis client: a URL, a Sentinel-watched master, or a Cluster.

`RedisTarget` is the one description of "which Redis" (the consumer's ServiceSettings, the ops
commands, the demo and `dgr tracker-sim` fill it from their options); `connect()` turns it into a
redis-py client and `connect_async()` into a redis.asyncio one. The transport and the producer take
the client as it is: none of them knows whether a Sentinel stands behind it.

* URL only: `redis.Redis.from_url` (or `RedisCluster.from_url` with `cluster`). Users, passwords, TLS
  (`rediss://`, `ssl_*` query arguments) and the db come from the URL.
* Sentinel (`sentinel` "host:port[,host:port...]" and `sentinel_master`): redis-py's Sentinel client.
  The master's connections take the URL's user, password, db and TLS settings (its host and port are
  not used: the sentinels name the master); the sentinels' own connections take the URL's TLS settings
  and `sentinel_username` / `sentinel_password` (a Sentinel's `requirepass` or ACL user is its own).
  Each new connection asks the sentinels where the master is, so after a failover the next connection
  goes to the promoted replica; until then a call fails with a ConnectionError (MasterNotFoundError
  while the master is down and not yet replaced, or a refused connection), which the transport and
  the producer ride through as an outage (schemas/retry.py). A demoted master's READONLY reply is
  turned by redis-py into a ConnectionError too, and the pool reconnects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import ClusterPipeline, RedisCluster
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

from .packer import packer_kwargs

if TYPE_CHECKING:
    import redis.asyncio as aioredis

__all__ = ["DEFAULT_URL", "RedisTarget", "connect", "connect_async", "master_address", "master_url", "parse_sentinels",
           "sentinel_settings"]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SENTINEL_TIMEOUT_S = 5.0  # a sentinel answers at once or is skipped for the next one


def parse_sentinels(text: str) -> list[tuple[str, int]]:
    """'h1:26379,h2:26379' (IPv6 as '[::1]:26379') -> [(host, port), ...]. Empty text: no sentinel."""
    out: list[tuple[str, int]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {item!r} is not host:port")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        out.append((host, int(port)))
    return out


@dataclass(frozen=True)
class RedisTarget:
    """Which Redis a process talks to. `sentinel` set: the master `sentinel_master` that those sentinels
    watch, with the URL's credentials, db and TLS; `cluster`: the URL names one node of a Cluster."""

    url: str = DEFAULT_URL
    sentinel: str = ""
    sentinel_master: str = ""
    sentinel_username: str = ""
    sentinel_password: str = ""
    cluster: bool = False

    def __post_init__(self) -> None:
        sentinels = parse_sentinels(self.sentinel)  # raises on a malformed address
        if sentinels and not self.sentinel_master:
            raise ValueError("--redis-sentinel needs --sentinel-master (the name the sentinels monitor)")
        if self.sentinel_master and not sentinels:
            raise ValueError("--sentinel-master needs --redis-sentinel host:port[,host:port...]")
        if sentinels and self.cluster:
            raise ValueError("a Redis Cluster has no sentinels: give --redis-sentinel or --cluster, not both")

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return parse_sentinels(self.sentinel)

    def describe(self) -> str:
        """For logs and banners: where, without any password."""
        if self.sentinel:
            return f"sentinel master {self.sentinel_master!r} via {self.sentinel}"
        return ("cluster " if self.cluster else "") + _redacted(self.url)

    def env(self) -> dict[str, str]:
        """The DGR_* variables that make a child `dgr` process (a consumer) connect the same way."""
        out = {"DGR_REDIS_URL": self.url, "DGR_REDIS_CLUSTER": "1" if self.cluster else "0"}
        if self.sentinel:
            out |= {"DGR_REDIS_SENTINEL": self.sentinel, "DGR_SENTINEL_MASTER": self.sentinel_master,
                    "DGR_SENTINEL_USERNAME": self.sentinel_username, "DGR_SENTINEL_PASSWORD": self.sentinel_password}
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> RedisTarget:
        """The target the DGR_* variables of `env()` (the `dgr` options' variables) describe: for a
        process that takes no options, such as an RQ worker running the ops jobs."""
        return cls(url=environ.get("DGR_REDIS_URL") or DEFAULT_URL, sentinel=environ.get("DGR_REDIS_SENTINEL", ""),
                   sentinel_master=environ.get("DGR_SENTINEL_MASTER", ""),
                   sentinel_username=environ.get("DGR_SENTINEL_USERNAME", ""),
                   sentinel_password=environ.get("DGR_SENTINEL_PASSWORD", ""),
                   cluster=environ.get("DGR_REDIS_CLUSTER", "").lower() in ("1", "true", "yes", "on"))


def _redacted(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    if p.password is None:
        return url
    netloc = f"{p.username or ''}:***@{p.hostname or ''}" + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))


def _master_kwargs(url: str) -> dict[str, Any]:
    """The URL's connection settings for a master the sentinels name: everything but where it is."""
    kw = parse_url(url)
    kw.pop("host", None)
    kw.pop("port", None)
    cls = kw.pop("connection_class", None)
    if cls is UnixDomainSocketConnection:
        raise ValueError("a unix:// URL cannot name a Sentinel-watched master: use redis:// or rediss://")
    if cls is SSLConnection:
        kw["ssl"] = True  # SentinelConnectionPool then uses its TLS connection class
    return kw


def _sentinel_kwargs(target: RedisTarget, master_kw: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """The sentinels' own connections: the URL's TLS settings, the sentinel credentials, short timeouts."""
    kw: dict[str, Any] = {k: v for k, v in master_kw.items() if k == "ssl" or k.startswith("ssl_")}
    kw |= {"socket_connect_timeout": timeout_s, "socket_timeout": timeout_s}
    if target.sentinel_username:
        kw["username"] = target.sentinel_username
    if target.sentinel_password:
        kw["password"] = target.sentinel_password
    return kw


def sentinel_settings(target: RedisTarget, client_kw: Mapping[str, Any] | None = None
                      ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the master's connection settings, the sentinels' own) of a Sentinel target: what `connect`
    gives redis-py's Sentinel, for a tool that builds its own (RQ's settings, consumer/ops/rq_settings.py)."""
    client_kw = client_kw or {}
    master_kw = _master_kwargs(target.url) | dict(client_kw)
    timeout = float(client_kw.get("socket_connect_timeout") or SENTINEL_TIMEOUT_S)
    return master_kw, _sentinel_kwargs(target, master_kw, timeout)


def _sentinel(target: RedisTarget, client_kw: Mapping[str, Any], cls: Any = None) -> tuple[Any, dict[str, Any]]:
    """A Sentinel client (`cls`: redis-py's, or its asyncio twin) and the master's connection settings."""
    if cls is None:
        from redis.sentinel import Sentinel as cls
    master_kw, sentinel_kw = sentinel_settings(target, client_kw)
    return cls(target.sentinels, sentinel_kwargs=sentinel_kw), master_kw


class _KeysFromALiveNode:
    """A RedisCluster's commands parser that, when the node it asks for a command's keys cannot be
    reached, makes the client pick another default node before the error goes on (see FailoverCluster).
    Everything else is the wrapped parser's."""

    def __init__(self, parser: Any, client: RedisCluster) -> None:
        self._parser, self._client = parser, client

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        try:
            return self._parser.get_keys(redis_conn, *args)
        except (redis.ConnectionError, redis.TimeoutError):
            self._client.replace_default_node()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class FailoverClusterPipeline(ClusterPipeline):
    """A Cluster pipeline that raises a connection error or timeout even with raise_on_error=False, as
    a single-node pipeline does: redis-py re-runs the commands a MOVED sent elsewhere one by one and
    keeps their exceptions as replies, so after a failover a caller that asked for replies (the
    consumer's multi-stream read) got a ConnectionError as a "reply" and raised it outside its outage
    policy (tests/test_failover.py's Cluster test: the consumer exited). Raised here, the policy retries
    the whole pipeline, which every pipeline of dgr allows (schemas/retry.py)."""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        replies = super().execute(raise_on_error)
        for reply in replies:
            if isinstance(reply, (redis.ConnectionError, redis.TimeoutError)):
                raise reply
        return list(replies)


class FailoverCluster(RedisCluster):
    """A RedisCluster that replaces its default node when it cannot reach it to find a command's keys.

    redis-py asks its default node (COMMAND GETKEYS) for the keys of a command with movable keys
    (XREAD, XREADGROUP), in a pipeline too, before its own retry-and-refresh logic runs: with that node
    killed, every such call failed with ConnectionError for as long as the process lived (redis-py 8.1;
    found by tests/test_failover.py's Cluster test: neither the producer's XREAD nor the consumer's
    XREADGROUP pipeline ever recovered). The error is still raised (the caller's outage policy retries);
    the next try asks another node. Pipelines share the client's parser, so they get it too, and are
    FailoverClusterPipelines.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _KeysFromALiveNode(self.commands_parser, self)  # type: ignore[assignment]

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        pipe.__class__ = FailoverClusterPipeline  # redis-py builds it; only execute() differs
        return pipe


def connect(target: RedisTarget, *, decode: bool = False, redis_class: type[redis.Redis] = redis.Redis,
            **client_kw: Any) -> redis.Redis | RedisCluster:
    """A synchronous client for `target`. `client_kw` (socket timeouts, ...) reach every connection to
    the data (not the sentinels'); `redis_class` is the class of a non-Cluster client (a subclass that
    counts round trips, say). Its commands are packed in one C call where that packs them as redis-py would
    (consumer/packer.py)."""
    if target.sentinel:
        sentinel, master_kw = _sentinel(target, client_kw)
        return sentinel.master_for(target.sentinel_master, redis_class=redis_class,
                                   decode_responses=decode, **packer_kwargs(master_kw))
    if target.cluster:  # RedisCluster drops a command_packer it is given (redis-py's cleanup_kwargs)
        return FailoverCluster.from_url(target.url, decode_responses=decode, **client_kw)
    return redis_class.from_url(target.url, decode_responses=decode,
                                **packer_kwargs(client_kw, parse_url(target.url)))


def connect_async(target: RedisTarget, *, decode: bool = False,
                  **client_kw: Any) -> aioredis.Redis | aioredis.RedisCluster:
    """`connect` for asyncio (redis.asyncio: its Sentinel, its Cluster client)."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel as AsyncSentinel

    if target.sentinel:
        sentinel, master_kw = _sentinel(target, client_kw, AsyncSentinel)
        return sentinel.master_for(target.sentinel_master, decode_responses=decode,
                                   **master_kw)
    if target.cluster:
        return aioredis.RedisCluster.from_url(target.url, decode_responses=decode, **client_kw)
    return aioredis.Redis.from_url(target.url, decode_responses=decode, **client_kw)


def master_address(target: RedisTarget) -> tuple[str, int]:
    """Where the data lives now: the master the sentinels name, else the URL's host and port."""
    if target.sentinel:
        sentinel, _ = _sentinel(target, {})
        try:
            host, port = sentinel.discover_master(target.sentinel_master)
        finally:
            sentinel.close()
        return str(host), int(port)
    kw = parse_url(target.url)
    return str(kw.get("host", "127.0.0.1")), int(kw.get("port", 6379))


def master_url(target: RedisTarget) -> str:
    """The URL with the current master's address in it (the target's own URL without sentinels): for a
    tool that only takes a URL. It goes stale at the next failover."""
    if not target.sentinel:
        return target.url
    from urllib.parse import urlsplit, urlunsplit

    host, port = master_address(target)
    p = urlsplit(target.url)
    userinfo = p.netloc.rpartition("@")[0]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return urlunsplit((p.scheme, f"{userinfo}@{where}" if userinfo else where, p.path, p.query, p.fragment))
