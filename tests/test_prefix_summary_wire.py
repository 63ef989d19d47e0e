"""The prefix summary on the wire (docs/wire-format.md), on a real redis-server: the heartbeat names the
summary's version, the ids live at WorkerKeys.prefix_summary, written only when they change and kept alive with
the heartbeat (written again when Redis lost the key); a Tracker reads the summary only when the version its
heartbeat names is not the one it read last, and never a summary of another version."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis

from dgrtools.localredis import LocalRedis, find_redis_server
from producer import Producer
from schemas import WorkerKeys
from schemas.prefix import PrefixSummary
from tests.test_ops_support import register

IDS = [f"{i:032x}" for i in range(40)]


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    if find_redis_server() is None:
        pytest.skip("redis-server not installed")
    with LocalRedis(appendonly=False) as s:
        yield s


def beat(t: object, ids: list[str]) -> None:
    t.heartbeat({"slots": 4}, PrefixSummary.of(16, "account", ids))  # type: ignore[attr-defined]


def test_the_worker_writes_its_summary_apart_and_only_when_it_changed(server: LocalRedis) -> None:
    c = redis.Redis.from_url(server.url)
    c.flushall()
    t, k = register(c, "w1"), WorkerKeys("w1")
    beat(t, IDS)
    hb = json.loads(c.get(k.heartbeat))  # type: ignore[arg-type]
    doc = json.loads(c.get(k.prefix_summary))  # type: ignore[arg-type]
    assert "ids" not in hb["prefix"] and hb["prefix"]["n"] == 40
    assert doc["ids"] == IDS and doc["version"] == hb["prefix"]["version"]
    assert len(c.get(k.heartbeat)) < 400  # type: ignore[arg-type]
    c.set(k.prefix_summary, "marker")  # the same summary again: refreshed, not written
    beat(t, IDS)
    assert c.get(k.prefix_summary) == b"marker" and c.ttl(k.prefix_summary) > 0
    c.delete(k.prefix_summary)  # Redis lost it: the next beat finds it gone, the one after writes it
    beat(t, IDS)
    beat(t, IDS)
    assert json.loads(c.get(k.prefix_summary))["ids"] == IDS  # type: ignore[arg-type]
    beat(t, IDS[:10])  # changed: written with the beat that names it
    assert json.loads(c.get(k.prefix_summary))["ids"] == IDS[:10]  # type: ignore[arg-type]
    assert json.loads(c.get(k.heartbeat))["prefix"]["n"] == 10  # type: ignore[arg-type]


def test_the_tracker_reads_a_summary_once_per_version(server: LocalRedis) -> None:
    c = redis.Redis.from_url(server.url)
    c.flushall()
    t, k = register(c, "w1"), WorkerKeys("w1")
    prod = Producer(c)
    beat(t, IDS)
    (w,) = prod.workers()
    assert w.heartbeat["prefix"]["ids"] == IDS
    assert PrefixSummary.parse(w.heartbeat["prefix"]) == PrefixSummary.of(16, "account", IDS)
    doc = json.loads(c.get(k.prefix_summary))  # type: ignore[arg-type]
    c.set(k.prefix_summary, json.dumps({**doc, "ids": IDS[:3]}))  # the same version: not read again
    beat(t, IDS)
    (w,) = prod.workers()
    assert w.heartbeat["prefix"]["ids"] == IDS
    beat(t, IDS[:5])  # a new version, then a key that holds another one: no summary rather than a wrong one
    c.set(k.prefix_summary, json.dumps({**doc, "ids": IDS[:3]}))
    (w,) = prod.workers()
    assert "prefix" not in w.heartbeat
    c.set(k.prefix_summary, "not json {")
    (w,) = prod.workers()
    assert "prefix" not in w.heartbeat
    beat(t, IDS[:7])
    (w,) = prod.workers()
    assert w.heartbeat["prefix"]["ids"] == IDS[:7]
    c.delete(k.heartbeat)
    assert prod.workers()[0].heartbeat == {}
