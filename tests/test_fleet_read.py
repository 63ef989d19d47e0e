"""The Tracker's fleet read (producer/validate.py `workers`): every worker id that ever advertised stays in the
index (a new one per pod as workers come and go), so a read costs O(workers that beat): their heartbeats' TTLs
and drain keys are asked, dead workers' are not, and an advertisement is read again only when the version its
heartbeat names changed (or it names none). Driven on the sans-I/O core against a dict of keys, each command
counted; and once on a real Redis Cluster (the MGET split by slot)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.cluster import RedisCluster

from producer import Producer, ProducerCore
from producer.commands import Exists, Get, MGet, PTtl, Read, SMembers
from schemas import WorkerKeys
from schemas.heartbeat import spec_version
from schemas.keys import WORKERS_INDEX
from schemas.limits import WIRE_VERSION
from tests.fixtures.cluster import cluster_client, redis_cluster  # noqa: F401 (fixtures)
from tests.test_transport import make_key


class Keys:
    """The keys a fleet read asks for, and what it asked."""

    def __init__(self) -> None:
        self.kv: dict[str, Any] = {}
        self.index: set[str] = set()
        self.asked: Counter[tuple[str, str]] = Counter()  # (command, key)

    def advertise(self, w: str, ctx: int = 4096) -> str:
        body = json.dumps({"worker_id": w, "keys": [make_key(p, ctx).model_dump(mode="json")
                                                     for p in ("prefill", "decode")],
                           "info": {"wire_version": WIRE_VERSION, "slots": 4, "ctx": ctx}})
        self.kv[WorkerKeys(w).spec] = body
        self.index.add(w)
        return spec_version(body)

    def beat(self, w: str, named: str | None) -> None:
        hb = {"ts": 1.0, "ttl_s": 10, "slots": 4, "busy_slots": 0, **({"spec": named} if named else {})}
        self.kv[WorkerKeys(w).heartbeat] = json.dumps(hb)

    def die(self, w: str) -> None:
        self.kv.pop(WorkerKeys(w).heartbeat, None)

    def reply(self, req: Read) -> list[Any]:
        out: list[Any] = []
        for c in req.cmds:
            if isinstance(c, SMembers):
                out.append(sorted(self.index))
            elif isinstance(c, MGet):
                self.asked.update(("mget", k) for k in c.keys)
                out.append([self.kv.get(k) for k in c.keys])
            elif isinstance(c, Get):
                self.asked[("get", c.key)] += 1
                out.append(self.kv.get(c.key))
            elif isinstance(c, PTtl):
                self.asked[("pttl", c.key)] += 1
                out.append(4000 if c.key in self.kv else -2)
            elif isinstance(c, Exists):
                self.asked[("exists", c.key)] += 1
                out.append(c.key in self.kv)
            else:
                raise AssertionError(c)
        return out


def read(core: ProducerCore, keys: Keys) -> dict[str, Any]:
    plan = core.workers()
    reply = None
    try:
        while True:
            reply = keys.reply(plan.send(reply))
    except StopIteration as stop:
        return {w.worker_id: w for w in stop.value}


def test_dead_workers_cost_one_mget_entry_and_unchanged_advertisements_are_not_read_again() -> None:
    keys, core = Keys(), ProducerCore()
    live = [f"live-{i}" for i in range(3)]
    dead = [f"dead-{i}" for i in range(50)]
    for w in live:
        keys.beat(w, keys.advertise(w))
    for w in dead:
        keys.advertise(w)
    first = read(core, keys)
    assert sorted(first) == sorted(live + dead)
    assert all(first[w].alive and first[w].heartbeat_age_s == 6.0 for w in live)  # ttl 10 - PTTL 4 s
    assert not any(first[w].alive for w in dead) and first[dead[0]].keys == first[live[0]].keys
    keys.asked.clear()
    again = read(core, keys)
    assert {w: (i.alive, i.keys, i.info) for w, i in again.items()} == \
        {w: (i.alive, i.keys, i.info) for w, i in first.items()}
    asked = Counter(cmd for cmd, _ in keys.asked.elements())
    assert asked == {"mget": 53, "pttl": 3, "exists": 3}, asked  # no spec read: nothing changed


def test_a_new_advertisement_is_read_when_its_heartbeat_names_it_and_a_gone_id_is_forgotten() -> None:
    keys, core = Keys(), ProducerCore()
    keys.beat("w", keys.advertise("w", ctx=4096))
    keys.advertise("old")  # a worker from before: its heartbeat names no version
    keys.beat("old", None)
    read(core, keys)
    keys.asked.clear()
    keys.beat("w", keys.advertise("w", ctx=2048))  # registered anew (another model)
    got = read(core, keys)
    assert {k.recipe.ctx_per_session for k in got["w"].keys} == {2048}
    assert keys.asked[("get", WorkerKeys("w").spec)] == 1 and keys.asked[("get", WorkerKeys("old").spec)] == 1
    keys.index.discard("old")
    read(core, keys)
    assert "old" not in core.advertised.last


def test_an_unreadable_advertisement_is_one_worker_without_keys(caplog: pytest.LogCaptureFixture) -> None:
    keys, core = Keys(), ProducerCore()
    keys.beat("good", keys.advertise("good"))
    for w, garbage in (("junk", "{not json"), ("list", "[1, 2]"), ("badkey", '{"keys": [{"v": "x"}]}')):
        keys.kv[WorkerKeys(w).spec] = garbage
        keys.index.add(w)
        keys.beat(w, spec_version(garbage))
    for _ in range(2):
        got = read(core, keys)
        assert got["good"].keys and all(got[w].keys == [] for w in ("junk", "list", "badkey"))
    assert caplog.text.count("an unreadable advertisement") == 3  # once each, not at every read


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["beat", "die", "advertise",
                                                                          "advertise_silently", "leave"])),
                max_size=25))
def test_any_history_reads_what_a_fresh_tracker_reads(steps: list[tuple[str, str]]) -> None:
    """Whatever the workers did between two reads (beat, die, register anew with or without naming it, leave the
    index), a Tracker that read before answers as one reading for the first time: its caches only save reads."""
    keys, kept = Keys(), ProducerCore()
    ctx = {"a": 4096, "b": 4096, "c": 4096}
    for w, what in steps:
        if what == "advertise" or what == "advertise_silently":
            ctx[w] = 6144 - ctx[w] // 2 if ctx[w] != 4096 else 2048
            version = keys.advertise(w, ctx[w])
            if what == "advertise" and WorkerKeys(w).heartbeat in keys.kv:
                keys.beat(w, version)
        elif what == "beat" and WorkerKeys(w).spec in keys.kv:
            keys.beat(w, spec_version(keys.kv[WorkerKeys(w).spec]))
        elif what == "die":
            keys.die(w)
        elif what == "leave":
            keys.index.discard(w)
        seen = read(kept, keys)
        fresh = read(ProducerCore(), keys)
        assert {w: (i.alive, i.heartbeat_age_s, i.draining) for w, i in seen.items()} == \
            {w: (i.alive, i.heartbeat_age_s, i.draining) for w, i in fresh.items()}
        # the advertisement of a worker that beats naming the one stored (a fresh Tracker reads the key; a worker
        # that stopped beating keeps the one read last, and between a registration and the heartbeat that names
        # it, one loop iteration of the worker, the one named before stands)
        named = {w for w, i in fresh.items() if i.alive and i.heartbeat.get("spec") == spec_version(
            keys.kv[WorkerKeys(w).spec])}
        assert {w: seen[w].keys for w in named} == {w: fresh[w].keys for w in named}


def test_a_fleet_read_on_a_cluster(cluster_client: RedisCluster) -> None:  # noqa: F811
    c = cluster_client
    for w in ("fr-0", "fr-1", "fr-2", "fr-3"):  # spread over the nodes by their hash tags
        body = json.dumps({"worker_id": w, "keys": [make_key(p).model_dump(mode="json") for p in ("prefill", "decode")],
                           "info": {"wire_version": WIRE_VERSION}})
        c.set(WorkerKeys(w).spec, body)
        c.sadd(WORKERS_INDEX, w)
        if w != "fr-3":
            c.set(WorkerKeys(w).heartbeat, json.dumps({"ts": 1.0, "ttl_s": 10, "spec": spec_version(body)}), ex=10)
    assert len({c.get_node_from_key(WorkerKeys(w).base).name for w in ("fr-0", "fr-1", "fr-2", "fr-3")}) > 1
    got = {w.worker_id: w for w in Producer(c).workers()}  # type: ignore[arg-type]
    assert {w: i.alive for w, i in got.items()} == {"fr-0": True, "fr-1": True, "fr-2": True, "fr-3": False}
    assert all(i.heartbeat_age_s is not None and i.heartbeat_age_s < 2 for w, i in got.items() if i.alive)
