"""One live consumer per worker id (the lease, its fencing) and riding through Redis outages (the
retry policy), at the transport level. Against fakeredis[lua] and real Redis where nothing blocks;
the standby that waits for a lapse runs on real Redis only. Counts are asserted, never durations.
"""

from __future__ import annotations

import subprocess
import threading
from typing import Any

import pytest
import redis

from consumer.transport import LeaseHeld, LeaseLost, RedisTransport, TransportSettings
from schemas import WorkerKeys
from schemas.retry import OutageRider, RetryPolicy, transient
from tests.test_transport import completions_for, make_job, make_key, push
from tests.transport_support import complete_entries

WORKER = "lw"
KEYS = [make_key("prefill"), make_key("decode")]


def transport(client: redis.Redis, instance: str, lease_ms: int = 10_000) -> RedisTransport:
    t = RedisTransport(client, WORKER, WORKER, TransportSettings(lease_ms=lease_ms))
    t.instance_id = instance  # another host: the same-host dead-pid shortcut does not apply
    return t


def test_a_second_consumer_refuses_while_the_first_holds_the_lease(redis_client: redis.Redis) -> None:
    a, b = transport(redis_client, "host-a:1:x"), transport(redis_client, "host-b:1:y")
    token = a.acquire_lease(wait=False)
    assert token.startswith("1:host-a:1:x")
    with pytest.raises(LeaseHeld) as e:
        b.acquire_lease(wait=False)
    assert e.value.holder == token
    a.release_lease()
    assert b.acquire_lease(wait=False).startswith("2:host-b")


def test_a_fenced_holder_writes_nothing(redis_client: redis.Redis) -> None:
    a, b = transport(redis_client, "host-a:1:x"), transport(redis_client, "host-b:1:y")
    a.acquire_lease(wait=False)
    _pre, dec = a.register(KEYS, {})
    b.register(KEYS, {})
    push(redis_client, dec, [make_job("s", 1)])
    held = a.read_streams({dec: 1}, block_ms=0)
    redis_client.delete(WorkerKeys(WORKER).lease)  # a's lease lapsed (a paused)...
    b.acquire_lease(wait=False)  # ...and b took over
    with pytest.raises(LeaseLost):
        complete_entries(a, completions_for(held))
    assert redis_client.xlen(a.keys.results("s")) == 0 and not redis_client.exists(a.keys.worker_account)
    with pytest.raises(LeaseLost):
        a.renew_lease()
    taken = b.read_streams({dec: 1}, block_ms=0)  # same consumer name: b's start-up pending re-read has it
    assert [d.entry_id for d in taken] == [d.entry_id for d in held]
    assert complete_entries(b, completions_for(taken)) == [True]


def test_a_lapsed_lease_nobody_took_is_taken_back(redis_client: redis.Redis) -> None:
    a = transport(redis_client, "host-a:1:x")
    token = a.acquire_lease(wait=False)
    _pre, dec = a.register(KEYS, {})
    push(redis_client, dec, [make_job("s", 1), make_job("t", 1)])
    held = a.read_streams({dec: 2}, block_ms=0)
    redis_client.delete(WorkerKeys(WORKER).lease)  # a long pause: lapsed, nobody else came
    assert complete_entries(a, completions_for(held[:1])) == [True]  # the completion takes it back
    assert redis_client.get(WorkerKeys(WORKER).lease) == token.encode()
    redis_client.delete(WorkerKeys(WORKER).lease)
    a.renew_lease()  # so does the renewal
    assert redis_client.get(WorkerKeys(WORKER).lease) == token.encode()
    redis_client.flushall()  # Redis lost its data set (a restart without persistence)
    a.register(KEYS, {})
    assert complete_entries(a, completions_for(held[1:])) == [True]  # not fenced by the loss: epoch restored
    assert redis_client.get(WorkerKeys(WORKER).lease_epoch) == b"1"


def test_an_epoch_lost_by_redis_does_not_fence_its_holder(redis_client: redis.Redis) -> None:
    """kill -9 of Redis with AOF everysec can lose the last second: the lease and the epoch's INCR."""
    transport(redis_client, "host-0:1:w").acquire_lease(wait=False)
    redis_client.delete(WorkerKeys(WORKER).lease)
    a = transport(redis_client, "host-a:1:x")
    assert a.acquire_lease(wait=False).startswith("2:")
    redis_client.set(WorkerKeys(WORKER).lease_epoch, 1)  # the INCR to 2 was lost...
    redis_client.delete(WorkerKeys(WORKER).lease)  # ...and the lease with it
    a.renew_lease()  # restores epoch 2 and takes its lease back
    assert redis_client.get(WorkerKeys(WORKER).lease_epoch) == b"2"
    b = transport(redis_client, "host-b:1:y")
    with pytest.raises(LeaseHeld):
        b.acquire_lease(wait=False)


def test_a_dead_holder_on_this_host_is_replaced_at_once(redis_client: redis.Redis) -> None:
    import socket

    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    transport(redis_client, f"{host}:{dead.pid}:x").acquire_lease(wait=False)
    b = RedisTransport(redis_client, WORKER, WORKER)  # this host, this (live) process
    assert b.acquire_lease(wait=False).startswith("2:")  # kill -9 then restart: no wait for the lapse
    redis_client.set(WorkerKeys(WORKER).lease, f"2:{host}:1:q", px=10_000)  # pid 1: alive
    with pytest.raises(LeaseHeld):
        RedisTransport(redis_client, WORKER, WORKER).acquire_lease(wait=False)


def test_a_standby_takes_over_when_the_lease_lapses(real_redis: redis.Redis) -> None:
    a = transport(real_redis, "host-a:1:x", lease_ms=300)
    a.acquire_lease(wait=False)
    b = transport(real_redis, "host-b:1:y", lease_ms=300)
    got: dict[str, str] = {}
    t = threading.Thread(target=lambda: got.update(token=b.acquire_lease(wait=True)))
    t.start()
    t.join(0.1)
    assert t.is_alive() and not got, "the standby did not wait"  # a holds it (renewed below)
    a.renew_lease()
    t.join(10)  # a stops renewing: the lease lapses and b takes it
    assert got["token"].startswith("2:host-b")
    with pytest.raises(LeaseLost):
        a.renew_lease()


# ------------------------------------------------------------------------------ riding an outage


class Flaky:
    """Wraps a client; the next `fail` calls of `name` raise `error`."""

    def __init__(self, inner: redis.Redis, name: str, fail: int, error: Exception) -> None:
        self.inner, self.name, self.fail, self.error, self.calls = inner, name, fail, error, 0

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self.inner, attr)
        if attr != self.name:
            return value

        def call(*a: Any, **k: Any) -> Any:
            self.calls += 1
            if self.fail > 0:
                self.fail -= 1
                raise self.error
            return value(*a, **k)

        return call


def test_transport_calls_ride_through_an_outage(redis_client: redis.Redis) -> None:
    t = RedisTransport(redis_client, WORKER, WORKER, TransportSettings(retry_base_s=0.001, retry_cap_s=0.002))
    t.register(KEYS, {})
    redis_client.xadd(t.keys.cancellations, {"session_id": "s1"})
    flaky = Flaky(redis_client, "xread", 3, redis.ConnectionError("connection refused"))
    t.client = flaky  # type: ignore[assignment]
    assert t.cancellations()[0] == ["s1"]
    assert flaky.calls == 4 and t.outages == 1
    flaky.fail, flaky.error = 2, redis.ResponseError("LOADING Redis is loading the dataset in memory")
    assert t.cancellations()[0] == []
    assert t.outages == 2


def test_not_transient_errors_are_raised_at_once_and_outages_are_bounded() -> None:
    assert transient(redis.ConnectionError()) and transient(redis.TimeoutError())
    assert transient(redis.ResponseError("READONLY You can't write against a read only replica."))
    assert transient(redis.exceptions.ReadOnlyError("You can't write against a read only replica."))
    assert transient(redis.exceptions.ClusterDownError("The cluster is down"))
    assert transient(redis.exceptions.MasterDownError("Link with MASTER is down"))
    assert not transient(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not transient(ValueError())
    import logging

    rider = OutageRider(RetryPolicy(max_s=0.0, base_s=0.0, cap_s=0.0), logging.getLogger("t"), "t")
    calls = [0]

    def down() -> None:
        calls[0] += 1
        raise redis.ConnectionError("down")

    with pytest.raises(redis.ConnectionError):
        rider.call(down)
    assert calls[0] >= 2 and rider.outages == 0  # retried, then given up (bounded)

    def wrong() -> None:
        calls[0] += 1
        raise redis.ResponseError("ERR syntax")

    calls[0] = 0
    with pytest.raises(redis.ResponseError):
        rider.call(wrong)
    assert calls[0] == 1


def test_a_completion_whose_reply_was_lost_is_resent_without_effect(redis_client: redis.Redis) -> None:
    t = RedisTransport(redis_client, WORKER, WORKER, TransportSettings(retry_base_s=0.001, retry_cap_s=0.002))
    t.acquire_lease(wait=False)
    _pre, dec = t.register(KEYS, {})
    push(redis_client, dec, [make_job("s", 1)])
    held = t.read_streams({dec: 1}, block_ms=0)
    real = t.io.scripts["complete"]
    calls = [0]

    def reply_lost(**kw: Any) -> Any:
        calls[0] += 1
        out = real(**kw)  # Redis ran it...
        if calls[0] == 1:
            raise redis.ConnectionError("connection reset")  # ...but the reply never came
        return out

    t.io.scripts["complete"] = reply_lost
    assert complete_entries(t, completions_for(held)) == [False]  # re-sent: the first call had answered it
    assert calls[0] == 2 and t.outages == 1
    assert redis_client.xlen(t.keys.results("s")) == 1
    assert redis_client.hget(t.keys.worker_account, "steps") == b"1"
    assert t.outstanding == 0
