"""Accounting roll-up: exactly once, idempotent, crash-safe (fakeredis[lua] and a real redis-server)."""

from __future__ import annotations

import contextlib
import math
import random

import fakeredis
import pytest
import redis
from rq import Queue

from consumer.ops.common import LEDGER_INDEX, ledger_key, s
from consumer.ops.jobs import enqueue_rollup, rollup_job
from consumer.ops.rollup import FOLD_LUA, Fold, fold_args, ledger_accounts, read_ledger, rollup
from dgrtools.localredis import LocalRedis
from schemas import WorkerKeys
from schemas.keys import WORKERS_INDEX
from tests.test_ops_support import register, serve


def expected(client: redis.Redis) -> dict[str, dict[str, float]]:
    """Sum of every worker's billing counters, per account: what the ledger must hold."""
    out: dict[str, dict[str, float]] = {}
    for w in client.smembers(WORKERS_INDEX):
        k = WorkerKeys(s(w))
        for a in client.smembers(k.accounts_index):
            tot = out.setdefault(s(a), {})
            for f, v in client.hgetall(k.billing_account(s(a))).items():
                tot[s(f)] = tot.get(s(f), 0.0) + float(v)
    return out


def assert_ledger_matches(client: redis.Redis) -> None:
    want = expected(client)
    assert ledger_accounts(client) == sorted(want)
    for aid, tot in want.items():
        got = read_ledger(client, aid).totals
        assert set(got) == set(tot), aid
        for f, v in tot.items():
            if f == "engine_seconds":
                assert math.isclose(got[f], v, rel_tol=1e-12), (aid, f, got[f], v)
            else:
                assert got[f] == v, (aid, f, got[f], v)


def test_rollup_folds_each_worker_once(redis_client: redis.Redis) -> None:
    t1, t2 = register(redis_client, "w1"), register(redis_client, "w2")
    serve(t1, {"s1": ("acct-a", 0), "s2": ("acct-b", 0)})
    serve(t2, {"s3": ("acct-a", 0), "s4": ("acct-c", 0)})
    rep = rollup(redis_client)
    assert rep.count("folded") == 4 and rep.count("regressed") == 0
    assert_ledger_matches(redis_client)
    a = read_ledger(redis_client, "acct-a")
    assert a.totals == {"prompt_tokens": 6, "generated_tokens": 2, "steps": 2, "engine_seconds": 0.5}
    assert set(a.by_worker) == {"w1", "w2"} and a.by_worker["w1"]["steps"] == 1 and a.folds == 2

    # A second run changes nothing at all.
    before = {aid: redis_client.hgetall(ledger_key(aid)) for aid in ("acct-a", "acct-b", "acct-c")}
    rep2 = rollup(redis_client)
    assert rep2.count("unchanged") == 4 and rep2.count("folded") == 0 and rep2.delta == {}
    assert {aid: redis_client.hgetall(ledger_key(aid)) for aid in before} == before

    # New work is folded as a difference.
    serve(t1, {"s1": ("acct-a", 1), "s5": ("acct-d", 0)})
    rep3 = rollup(redis_client)
    assert rep3.count("folded") == 2 and rep3.delta["steps"] == 2
    assert_ledger_matches(redis_client)
    assert read_ledger(redis_client, "acct-a").totals["steps"] == 3


def test_crash_between_accounts_then_rerun_gives_exact_totals(redis_client: redis.Redis) -> None:
    ts = [register(redis_client, w) for w in ("w1", "w2", "w3")]
    for i, t in enumerate(ts):
        serve(t, {f"s{i}{j}": (f"acct-{j}", 0) for j in range(4)})

    class Crash(RuntimeError):
        pass

    done: list[Fold] = []

    def crash_after_5(f: Fold) -> None:
        done.append(f)
        if len(done) == 5:
            raise Crash

    with pytest.raises(Crash):
        rollup(redis_client, on_fold=crash_after_5)
    # Work lands between the crash and the rerun, on a folded and on an unfolded pair.
    serve(ts[0], {"s00": ("acct-0", 1)})
    serve(ts[2], {"s23": ("acct-3", 1)})
    rep = rollup(redis_client)
    assert rep.count("folded") == 12 - 5 + 1  # the rest, plus the one folded pair that gained
    assert_ledger_matches(redis_client)
    assert rollup(redis_client).count("folded") == 0
    assert_ledger_matches(redis_client)


def test_a_stale_snapshot_is_refused(redis_client: redis.Redis) -> None:
    t = register(redis_client, "w1")
    serve(t, {"s1": ("acct-a", 0)})
    serve(t, {"s1": ("acct-a", 1)})
    rollup(redis_client)
    before = redis_client.hgetall(ledger_key("acct-a"))
    # A slower, concurrent roll-up that read the counters before the last step: smaller than the mark.
    fold = redis_client.register_script(FOLD_LUA)
    stale = {"prompt_tokens": "3", "generated_tokens": "1", "steps": "1", "engine_seconds": "0.25"}
    res = fold(keys=[ledger_key("acct-a"), LEDGER_INDEX], args=fold_args("acct-a", "w1", stale))
    assert int(res[0]) == -1
    assert redis_client.hgetall(ledger_key("acct-a")) == before


def test_random_interleavings_of_work_rollups_and_crashes(fake_redis: redis.Redis) -> None:
    """Counters grow at random; roll-ups crash at random points; the ledger always catches up exactly."""
    client = fake_redis
    rng = random.Random(7)
    workers = ["w1", "w2"]
    for w in workers:
        client.sadd(WORKERS_INDEX, w)
    for _ in range(40):
        w, a = rng.choice(workers), f"acct-{rng.randrange(4)}"
        k = WorkerKeys(w)
        client.hincrby(k.billing_account(a), "steps", rng.randrange(1, 5))
        client.hincrby(k.billing_account(a), "generated_tokens", rng.randrange(0, 9))
        client.hincrbyfloat(k.billing_account(a), "engine_seconds", rng.random())
        client.sadd(k.accounts_index, a)
        if rng.random() < 0.4:
            stop = rng.randrange(1, 6)
            n = [0]

            def maybe_crash(_: Fold, stop: int = stop, n: list[int] = n) -> None:
                n[0] += 1
                if n[0] == stop:
                    raise KeyboardInterrupt

            with contextlib.suppress(KeyboardInterrupt):
                rollup(client, on_fold=maybe_crash)
    rollup(client)
    assert_ledger_matches(client)


def test_rq_job_with_a_synchronous_queue(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    t = register(real_redis, "w1")
    serve(t, {"s1": ("acct-a", 0)})
    q = Queue("dgr-ops", connection=fakeredis.FakeRedis(), is_async=False)
    job = enqueue_rollup(q, redis_server.url)
    assert job.get_status() == "finished"
    assert (job.return_value() or {})["folded"] == 1
    assert read_ledger(real_redis, "acct-a").totals["steps"] == 1
    assert rollup_job(redis_server.url)["unchanged"] == 1  # the plain function, again: nothing new


def test_rq_job_takes_the_url_from_the_environment(redis_server: LocalRedis, real_redis: redis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    t = register(real_redis, "w1")
    serve(t, {"s1": ("acct-a", 0)})
    monkeypatch.setenv("DGR_REDIS_URL", redis_server.url)
    assert rollup_job()["folded"] == 1
    monkeypatch.delenv("DGR_REDIS_URL")
    with pytest.raises(ValueError):
        rollup_job()
