"""`dgr ops forget-gone` (consumer/ops/forget.py): a worker id is taken out of the fleet index only once no process
holds it (no heartbeat, no lease) since a look at least `gone_for_s` ago on Redis' clock, its accounting folded into
the ledger and its dead letters read; its keys stay; a worker that beats again is back in the index. On fakeredis
and a real redis-server."""

from __future__ import annotations

import json
import subprocess
import sys

import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.ops.forget import forget_gone
from consumer.ops.rollup import read_ledger
from consumer.transport import RedisTransport
from dgrtools.localredis import LocalRedis
from schemas import WorkerKeys
from schemas.keys import WORKERS_GONE, WORKERS_INDEX


def registered(client: redis.Redis, w: str, *, beats: bool = False, held: bool = False, tokens: int = 0) -> None:
    k = WorkerKeys(w)
    client.sadd(WORKERS_INDEX, w)
    client.set(k.spec, json.dumps({"worker_id": w, "keys": []}))
    if beats:
        client.set(k.heartbeat, json.dumps({"ts": 1.0}), ex=60)
    if held:
        client.set(k.lease, "someone", px=60_000)
    if tokens:
        client.sadd(k.accounts_index, "acct-f")
        client.hset(k.billing_account("acct-f"), mapping={"prompt_tokens": tokens, "generated_tokens": 1})


def statuses(client: redis.Redis, gone_for_s: float) -> dict[str, str]:
    return {x.worker_id: x.status for x in forget_gone(client, gone_for_s)}


def test_only_workers_gone_long_enough_folded_and_read_are_taken_out(redis_client: redis.Redis) -> None:
    c = redis_client
    registered(c, "up", beats=True)
    registered(c, "held", held=True)
    registered(c, "gone", tokens=7)
    registered(c, "letters")
    c.xadd(WorkerKeys("letters").dead_letters, {"x": "1"})
    assert statuses(c, 3600) == {"up": "up", "held": "held", "gone": "noted", "letters": "noted"}
    assert statuses(c, 3600) == {"up": "up", "held": "held", "gone": "waiting", "letters": "waiting"}
    assert [x.status for x in forget_gone(c, 0, worker_ids=["gone", "letters"], dry_run=True)] == \
        ["forgotten", "dead_letters"]
    assert c.sismember(WORKERS_INDEX, "gone")  # a dry run takes nothing out
    assert statuses(c, 0) == {"up": "up", "held": "held", "gone": "forgotten", "letters": "dead_letters"}
    assert not c.sismember(WORKERS_INDEX, "gone") and c.exists(WorkerKeys("gone").spec)  # its keys stay
    assert read_ledger(c, "acct-f").by_worker["gone"]["prompt_tokens"] == 7  # folded before it went
    assert not c.hexists(WORKERS_GONE, "gone") and c.hexists(WORKERS_GONE, "letters")
    assert sorted(x.decode() for x in c.smembers(WORKERS_INDEX)) == ["held", "letters", "up"]


def test_a_worker_found_back_loses_its_mark_and_one_that_beats_again_is_back_in_the_index(
        redis_client: redis.Redis) -> None:
    c = redis_client
    registered(c, "w")
    assert statuses(c, 3600) == {"w": "noted"}
    c.set(WorkerKeys("w").heartbeat, json.dumps({"ts": 1.0}), ex=60)  # back before it was forgotten
    assert statuses(c, 0) == {"w": "up"} and not c.hexists(WORKERS_GONE, "w")
    c.delete(WorkerKeys("w").heartbeat)
    statuses(c, 0)
    assert statuses(c, 0) == {"w": "forgotten"}
    RedisTransport(c, "w").heartbeat({"slots": 2})  # the worker comes back: its next beat adds it again
    assert c.sismember(WORKERS_INDEX, "w")


def test_the_command(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    registered(real_redis, "cmd-gone")
    run = [sys.executable, "-m", "consumer", "ops", "forget-gone", "--redis-url", redis_server.url,
           "--gone-for-s", "0", "--json"]
    first = json.loads(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
    second = json.loads(subprocess.run(run, capture_output=True, text=True, check=True).stdout)
    assert [x["status"] for x in first] == ["noted"] and [x["status"] for x in second] == ["forgotten"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["start", "stop", "charge", "look"]),
                          st.integers(1, 5)), max_size=25))
def test_any_history_loses_no_worker_that_runs_and_no_charge(redis_client: redis.Redis,
                                                              steps: list[tuple[str, str, int]]) -> None:
    """Workers start (heartbeat, lease, each beat SADDs it), stop, charge while they run, and forget-gone looks
    (gone_for 0: a worker is taken out at its second look while gone), in any order: a running worker is in the index
    after every beat, and a roll-up through the index then folds every charge ever made, forgotten workers' too."""
    c = redis_client
    c.flushall()
    charged = {"a": 0, "b": 0}
    for w, what, n in steps:
        k = WorkerKeys(w)
        running = bool(c.exists(k.lease))
        if what == "start" or (what == "charge" and running):
            c.set(k.lease, "me", px=60_000)
            RedisTransport(c, w).heartbeat({"slots": 1})  # what a running worker writes, SADD included
        if what == "stop":
            c.delete(k.lease, k.heartbeat)
        elif what == "charge" and running:
            c.sadd(k.accounts_index, "acct-h")
            c.hincrby(k.billing_account("acct-h"), "prompt_tokens", n)
            charged[w] += n
        elif what == "look":
            forget_gone(c, 0)
        for x in ("a", "b"):
            if c.exists(WorkerKeys(x).heartbeat):
                assert c.sismember(WORKERS_INDEX, x), (x, steps)
    from consumer.ops.rollup import rollup

    rollup(c)
    total = read_ledger(c, "acct-h").totals.get("prompt_tokens", 0) if sum(charged.values()) else 0
    assert total == sum(charged.values()), (charged, steps)
