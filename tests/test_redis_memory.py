"""A Redis that evicts at its maxmemory loses dgr's keys (consumer/transport/memory.py): a worker refuses to start
on one unless told it may; a full Redis under noeviction refuses writes, ridden through as an outage
(tests/test_refused_writes.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from consumer.config import TransportSettings
from consumer.transport import EvictingRedis, RedisTransport
from consumer.transport.memory import evicting, eviction_policies
from dgrtools.localredis import LocalRedis, free_port

EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random",
            "volatile-ttl")


@pytest.fixture
def policy(real_redis: redis.Redis) -> Iterator[redis.Redis]:
    """The session's redis-server, its policy set back to noeviction whatever the test did."""
    try:
        yield real_redis
    finally:
        real_redis.config_set("maxmemory-policy", "noeviction")


def test_only_noeviction_keeps_every_key() -> None:
    assert evicting({"": "noeviction"}) is None
    assert evicting(None) is None  # nothing read: not judged
    for p in EVICTING:
        said = evicting({"": p})
        assert said is not None and p in said and "noeviction" in said and "--allow-eviction" in said
    mixed = evicting({"a:1": "noeviction", "b:2": "volatile-ttl"})
    assert mixed is not None and "volatile-ttl on b:2" in mixed and "a:1" not in mixed


@pytest.mark.parametrize("p", ["allkeys-lru", "volatile-ttl"])
def test_a_worker_refuses_a_redis_that_evicts_and_writes_nothing(policy: redis.Redis, p: str) -> None:
    policy.config_set("maxmemory-policy", p)
    assert eviction_policies(policy) == {"": p}
    t = RedisTransport(policy, "evict-w")
    with pytest.raises(EvictingRedis, match=p):
        t.acquire_lease(wait=False)
    assert not policy.keys("dgr:{evict-w}*"), "it wrote before refusing"


def test_allowed_it_starts_and_says_so(policy: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    policy.config_set("maxmemory-policy", "allkeys-lru")
    t = RedisTransport(policy, "evict-ok", settings=TransportSettings(allow_eviction=True))
    try:
        assert t.acquire_lease(wait=False)
        assert "starting anyway (--allow-eviction)" in caplog.text
    finally:
        t.release_lease()


def test_noeviction_starts(policy: redis.Redis) -> None:
    assert eviction_policies(policy) == {"": "noeviction"}
    t = RedisTransport(policy, "evict-none")
    try:
        assert t.acquire_lease(wait=False)
    finally:
        t.release_lease()


def test_a_server_that_answers_no_info_is_not_judged(fake_redis: redis.Redis) -> None:
    assert eviction_policies(fake_redis) is None  # fakeredis knows no INFO: a stand-in, or an ACL without it
    t = RedisTransport(fake_redis, "evict-fake")
    assert t.acquire_lease(wait=False)


def test_dgr_consumer_exits_3_on_a_redis_that_evicts(tiny_model_path: Path, tmp_path: Path) -> None:
    with LocalRedis(port=free_port(), data_dir=tmp_path / "r", appendonly=False,
                    extra_args=("--maxmemory-policy", "allkeys-lru")) as srv:
        run = subprocess.run([sys.executable, "-m", "consumer", "consumer", "--redis-url", srv.url, "--worker-id",
                              "evicting", "--model", str(tiny_model_path), "--engine", "reference", "--log-format",
                              "text"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 3, run.stdout[-2000:] + run.stderr[-2000:]
        said = run.stdout + run.stderr
        assert "refusing to start" in said and "maxmemory-policy allkeys-lru" in said, said[-2000:]
        assert not redis.Redis.from_url(srv.url).keys("dgr:*")


def test_a_redis_that_evicts_after_an_outage_is_said_loudly(policy: redis.Redis,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The look again at every registration after the first (after an outage: a failover may promote a server
    configured otherwise): an error in the log, the worker goes on with its sessions."""
    from tests.test_transport import make_key

    t = RedisTransport(policy, "evict-later")
    try:
        t.acquire_lease(wait=False)
        t.register([make_key("prefill"), make_key("decode")], {"slots": 2})
        assert "may evict" not in caplog.text
        policy.config_set("maxmemory-policy", "allkeys-lru")
        t.register([make_key("prefill"), make_key("decode")], {"slots": 2})  # as after an outage
        assert "maxmemory-policy allkeys-lru" in caplog.text and "seen after a Redis outage" in caplog.text
    finally:
        t.release_lease()
