"""consumer/connect.py: which client each RedisTarget gives, with which settings (no server needed for
most), and the Cluster client that survives losing its default node."""

from __future__ import annotations

import contextlib

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection, SentinelManagedSSLConnection

from consumer.connect import (
    FailoverCluster,
    FailoverClusterPipeline,
    RedisTarget,
    connect,
    connect_async,
    master_url,
    parse_sentinels,
)
from consumer.packer import OneCallPacker
from dgrtools.localredis import free_port
from schemas import WorkerKeys
from tests.fixtures.cluster import LocalCluster

SENTINELS = "10.0.0.1:26379,sentinel-b:26380,[::1]:26381"


def test_parse_sentinels() -> None:
    assert parse_sentinels(SENTINELS) == [("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381)]
    assert parse_sentinels(" a:1 , ,b:2,") == [("a", 1), ("b", 2)]
    assert parse_sentinels("") == []
    for bad in ("a", "a:", ":1", "a:0", "a:65536", "a:x", "a:1,b"):
        with pytest.raises(ValueError, match="host:port"):
            parse_sentinels(bad)


def test_a_target_refuses_contradictions() -> None:
    with pytest.raises(ValueError, match="--sentinel-master"):
        RedisTarget(sentinel="a:1")
    with pytest.raises(ValueError, match="--redis-sentinel"):
        RedisTarget(sentinel_master="m")
    with pytest.raises(ValueError, match="not both"):
        RedisTarget(sentinel="a:1", sentinel_master="m", cluster=True)


def _sentinel_client(url: str, **kw: str) -> redis.Redis:
    client = connect(RedisTarget(url=url, sentinel=SENTINELS, sentinel_master="dgr", **kw),
                     socket_connect_timeout=2, socket_timeout=7)
    assert isinstance(client, redis.Redis)
    return client


def test_a_sentinel_target_takes_auth_db_and_tls_from_the_url_and_its_own_credentials_apart() -> None:
    client = _sentinel_client("rediss://dgr-worker-w0:s3cret@ignored-host:1/3?ssl_cert_reqs=none",
                              sentinel_username="sent", sentinel_password="sentpw")
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "dgr"
    kw = pool.connection_kwargs
    assert pool.connection_class is SentinelManagedSSLConnection
    assert (kw["username"], kw["password"], kw["db"]) == ("dgr-worker-w0", "s3cret", 3)
    assert (kw["socket_connect_timeout"], kw["socket_timeout"], kw["ssl_cert_reqs"]) == (2, 7, "none")
    assert "host" not in kw and "port" not in kw  # the sentinels name the master
    assert isinstance(kw["command_packer"], OneCallPacker)  # the master's commands packed in one C call
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == parse_sentinels(SENTINELS)
    skw = sentinels[0].connection_pool.connection_kwargs
    assert (skw["username"], skw["password"]) == ("sent", "sentpw")  # not the master's
    assert sentinels[0].connection_pool.connection_class.__name__ == "SSLConnection"
    assert skw["socket_timeout"] == 2  # a sentinel answers at once or the next one is asked


def test_a_plain_sentinel_target_has_no_tls_and_no_sentinel_auth() -> None:
    pool = _sentinel_client("redis://127.0.0.1:6379/0").connection_pool
    assert pool.connection_class is SentinelManagedConnection
    skw = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs  # type: ignore[attr-defined]
    assert skw.get("password") is None and skw.get("username") is None
    assert pool.connection_kwargs.get("password") is None


def test_a_unix_socket_url_cannot_name_a_sentinel_master() -> None:
    with pytest.raises(ValueError, match="unix"):
        connect(RedisTarget(url="unix:///tmp/redis.sock", sentinel="a:1", sentinel_master="m"))


def test_plain_and_cluster_targets() -> None:
    plain = connect(RedisTarget(url="redis://u:p@h:6380/2"), decode=True)
    assert isinstance(plain, redis.Redis)
    kw = plain.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["decode_responses"]) == ("h", 6380, 2, "u", True)


def test_async_clients_are_the_same_kinds() -> None:
    import asyncio

    import redis.asyncio as aioredis

    async def main() -> None:
        client = connect_async(RedisTarget(url="redis://:pw@ignored:1/4", sentinel=SENTINELS,
                                           sentinel_master="dgr"))
        assert isinstance(client, aioredis.Redis)
        assert type(client.connection_pool).__name__ == "SentinelConnectionPool"
        assert client.connection_pool.connection_kwargs["db"] == 4
        assert client.connection_pool.connection_kwargs["password"] == "pw"
        await client.aclose()
        plain = connect_async(RedisTarget(url="redis://h:1/2"))
        assert isinstance(plain, aioredis.Redis) and plain.connection_pool.connection_kwargs["db"] == 2
        await plain.aclose()

    asyncio.run(main())


def test_describe_and_env_hide_nothing_they_should_not_show() -> None:
    t = RedisTarget(url="redis://u:secret@h:1/0", sentinel="a:1,b:2", sentinel_master="m", sentinel_password="sp")
    assert "secret" not in t.describe() and "a:1,b:2" in t.describe() and "'m'" in t.describe()
    assert "secret" not in RedisTarget(url="redis://u:secret@h:1/0").describe()
    env = t.env()  # what a child consumer needs, the passwords included (it is its environment)
    assert env["DGR_REDIS_SENTINEL"] == "a:1,b:2" and env["DGR_SENTINEL_MASTER"] == "m"
    assert env["DGR_SENTINEL_PASSWORD"] == "sp" and env["DGR_REDIS_URL"] == t.url
    assert "DGR_REDIS_SENTINEL" not in RedisTarget(url="redis://h:1/0").env()


def test_master_url_keeps_the_credentials_and_db(monkeypatch: pytest.MonkeyPatch) -> None:
    import consumer.connect as mod

    t = RedisTarget(url="rediss://u:p@ignored:1/5?ssl_cert_reqs=none", sentinel="a:1", sentinel_master="m")
    monkeypatch.setattr(mod, "master_address", lambda _t: ("10.1.2.3", 6390))
    assert master_url(t) == "rediss://u:p@10.1.2.3:6390/5?ssl_cert_reqs=none"
    monkeypatch.setattr(mod, "master_address", lambda _t: ("::1", 6390))
    assert master_url(RedisTarget(url="redis://ignored/0", sentinel="a:1", sentinel_master="m")) \
        == "redis://[::1]:6390/0"
    assert master_url(RedisTarget(url="redis://h:1/0")) == "redis://h:1/0"


def test_the_cluster_client_replaces_a_default_node_it_cannot_reach(redis_cluster: LocalCluster) -> None:
    """redis-py asks the default node for XREAD's keys: with that node gone, every XREAD failed for ever
    (plain RedisCluster below, still so on redis-py 8.2). FailoverCluster replaces the node it could not
    reach: on redis-py 8.1 that call still fails (the outage policy retries it) and the next one asks
    another node; on 8.2, whose own retry runs after the key lookup, the call itself succeeds."""
    client = connect(RedisTarget(url=redis_cluster.url, cluster=True))
    assert isinstance(client, FailoverCluster)
    stream = WorkerKeys("conn-w").results("s1")
    client.xadd(stream, {"a": "1"})
    dead = ClusterNode("127.0.0.1", free_port())
    dead.redis_connection = redis.Redis(port=dead.port, retry=Retry(NoBackoff(), 0))  # fail at once
    client.nodes_manager.default_node = dead
    with contextlib.suppress(redis.ConnectionError):  # raised on redis-py <= 8.1 only
        client.xread({stream: "0"})
    assert client.get_default_node() is not dead
    assert len(client.xread({stream: "0"})[0][1]) == 1  # type: ignore[index]
    client.nodes_manager.default_node = dead  # a pipeline (the consumer's reads) retries on its own: at once
    assert len(client.pipeline().xread({stream: "0"}).execute()[0][0][1]) == 1
    pipe = client.pipeline()
    assert isinstance(pipe, FailoverClusterPipeline)
    pipe.xread({stream: "0"}).execute(raise_on_error=False)  # a working pipeline is one
    lost = redis.ConnectionError("Error 111 connecting to a dead node")
    real_execute = ClusterPipeline.execute
    try:  # what redis-py returns after re-running a MOVED command against a dead default node
        ClusterPipeline.execute = lambda self, raise_on_error=True: [lost]  # type: ignore[method-assign]
        with pytest.raises(redis.ConnectionError):
            client.pipeline().xread({stream: "0"}).execute(raise_on_error=False)
    finally:
        ClusterPipeline.execute = real_execute  # type: ignore[method-assign]
    plain = RedisCluster.from_url(redis_cluster.url)
    plain.nodes_manager.default_node = dead
    for _ in range(2):  # what redis-py alone does: the same error every time (its pipeline recovers since 8.2)
        with pytest.raises(redis.ConnectionError):
            plain.xread({stream: "0"})
    client.delete(stream)
