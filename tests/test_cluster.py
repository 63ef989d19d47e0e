"""Redis Cluster: every key of a worker hashes to one slot, so its multi-key commands never CROSSSLOT.

Runs against a local 3-node cluster (tests/fixtures/cluster.py) with `redis.cluster.RedisCluster`;
two workers are placed on different nodes on purpose.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, ResponseError

from consumer.ops.common import LEDGER_INDEX, OpsKeys, ledger_key
from consumer.ops.deadletters import list_dead_letters, replay
from consumer.ops.inspect import inspect_fleet
from consumer.ops.reaper import reap
from consumer.ops.rollup import read_ledger, rollup
from consumer.transport import RedisTransport
from schemas import GROUP, WorkerKeys, job_to_fields
from schemas.keys import WORKERS_INDEX
from tests.fixtures.cluster import LocalCluster, cluster_client, redis_cluster  # noqa: F401 (fixtures)
from tests.test_ops_support import dead_letter, make_key, register, serve, step_job


def all_worker_keys(w: str) -> list[str]:
    k, o = WorkerKeys(w), OpsKeys(w)
    return [k.input_stream("0123456789abcdef", "prefill"), k.input_stream("0123456789abcdef", "decode"),
            k.input_pattern, k.results("s-1"), k.result_record("job-1"), k.dead_letters, k.cancellations,
            k.session_account("s-1"), k.billing_account("acct-1"), k.worker_account, k.accounts_index, k.spec,
            k.heartbeat, o.dlq_audit, o.dlq_replayed("1-0"), o.session_pattern]


def test_every_key_of_a_worker_is_in_one_slot() -> None:
    for w in ("w1", "worker-7", "gpu.3_a"):
        slots = {key_slot(x.encode()) for x in all_worker_keys(w)}
        assert slots == {key_slot(w.encode())}, w
    assert key_slot(ledger_key("a").encode()) == key_slot(LEDGER_INDEX.encode()) == key_slot(b"ledger")


def two_workers_on_different_nodes(client: RedisCluster) -> tuple[str, str]:
    first = "cw-0"
    node = client.get_node_from_key(WorkerKeys(first).base).name
    for i in range(1, 200):
        w = f"cw-{i}"
        if client.get_node_from_key(WorkerKeys(w).base).name != node:
            return first, w
    raise AssertionError("no two worker ids on different nodes")


def test_multi_stream_read_and_scripts_stay_in_one_slot(cluster_client: RedisCluster) -> None:  # noqa: F811
    c = cluster_client
    w1, w2 = two_workers_on_different_nodes(c)
    t1, t2 = register(c, w1), register(c, w2)  # type: ignore[arg-type]
    assert len(t1.streams) == 2
    # A multi-stream XREADGROUP (prefill + decode) of one worker.
    for t in (t1, t2):
        for phase, pos in (("prefill", 0), ("decode", 1)):
            c.xadd(t.keys.input_stream(make_key(phase).digest, phase),  # type: ignore[arg-type]
                   job_to_fields(step_job("s1", pos, worker=t.worker_id)))  # type: ignore[arg-type]
        got = c.xreadgroup(GROUP, "probe", {s: ">" for s in t.streams}, count=10)
        assert len(got) == 2
    # The completion script over a worker's keys (XACK, SET NX, XADD, HINCRBY x3) through the
    # transport, and the recovery/pending scripts.
    serve(t1, {"s2": ("acct-a", 0)})
    serve(t2, {"s3": ("acct-a", 0), "s4": ("acct-b", 0)})
    t1.recover_streams()
    dlq1 = dead_letter(t1, {"junk": "1"})
    # The same read across two workers is what a cluster refuses: the check above is a real one.
    with pytest.raises((RedisClusterException, ResponseError)):
        c.xreadgroup(GROUP, "probe", {t1.streams[0]: ">", t2.streams[0]: ">"}, count=1)

    # The control plane on the cluster: one slot per call.
    assert rollup(c).count("folded") == 3
    assert read_ledger(c, "acct-a").totals["steps"] == 2
    (d,) = list_dead_letters(c)
    assert d.ref == f"{w1}/{dlq1}"
    assert replay(c, w1, [dlq1], who="t")[0].status == "replayed"
    assert {x.status for x in reap(c, 0)} == {"cancelled"}
    assert sorted(t2.cancellations()[0]) == ["s3", "s4"]
    reports = {r.worker_id: r for r in inspect_fleet(c)}
    assert set(reports) == {w1, w2} and reports[w2].accounting["steps"] == 2
    assert c.smembers(WORKERS_INDEX) == {w1.encode(), w2.encode()}


# ------------------------------------------------------------------------- worker + producer (b)


def _wait_for(cond: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_workers_and_producers_through_the_cluster(redis_cluster: LocalCluster,  # noqa: F811
                                                   cluster_client: RedisCluster,  # noqa: F811
                                                   tiny_model_path: Path) -> None:
    """Two workers on different nodes side by side, 4 sessions each, one cancelled, one consumer
    restarted mid-run: everything completes through RedisCluster clients, no CROSSSLOT anywhere."""
    from consumer.engines.reference import NumpyReferenceEngine
    from consumer.worker import Worker, WorkerSettings
    from producer import Producer, SessionHandle
    from schemas import RouteHop, SessionSpec, StepResult

    w1, w2 = two_workers_on_different_nodes(cluster_client)

    def start_worker(w: str, consumer: str) -> tuple[Worker, threading.Thread]:
        eng = NumpyReferenceEngine(tiny_model_path, n_slots=4, ctx_per_session=128)
        wk = Worker(eng, RedisTransport(redis_cluster.client(), w, consumer),  # type: ignore[arg-type]
                    WorkerSettings(worker_id=w, heartbeat_s=0.2))
        wk.start()
        th = threading.Thread(target=wk.run, daemon=True)
        th.start()
        return wk, th

    running = {w: start_worker(w, f"{w}-a") for w in (w1, w2)}
    results: dict[str, dict[str, tuple[str, list[int]]]] = {}
    statuses: dict[str, list[str]] = {w1: [], w2: []}
    errors: list[BaseException] = []
    max_tokens = 16

    def drive(w: str) -> None:
        try:
            # One producer per worker: a Tracker's XREAD over result streams must stay within one slot.
            prod = Producer(redis_cluster.client(), timeout_s=60)  # type: ignore[arg-type]
            key = prod.discover(w).keys[0]
            specs = [(SessionSpec(session_id=f"{w}-s{i}", account_id=f"acct-{i % 2}",
                                  route=(RouteHop(worker_id=w, key=key),), max_tokens=max_tokens), [3 + i, 4, 5])
                     for i in range(4)]
            cancelled: set[str] = set()

            def on_result(h: SessionHandle, r: StepResult) -> None:
                statuses[w].append(r.status.value if r.reason is None else f"{r.status.value}:{r.reason.value}")
                if r.session_id.endswith("-s0") and r.session_id not in cancelled and h.generated:
                    cancelled.add(r.session_id)
                    prod.cancel(w, r.session_id)

            hs = prod.run_many(specs, on_result=on_result)
            results[w] = {sid: (h.status, list(h.generated)) for sid, h in hs.items()}
        except BaseException as e:
            errors.append(e)

    drivers = [threading.Thread(target=drive, args=(w,)) for w in (w1, w2)]
    for th in drivers:
        th.start()
    # Restart w2's consumer (a new process would do the same: new engine, new consumer name) while
    # its sessions are mid-decode: the new one answers their steps state_lost, the producer replays.
    acct2 = WorkerKeys(w2).worker_account
    _wait_for(lambda: int(cluster_client.hget(acct2, "steps") or 0) >= 8)
    wk, th = running[w2]
    wk.request_stop()
    th.join(30)
    steps_at_restart = int(cluster_client.hget(acct2, "steps") or 0)
    running[w2] = start_worker(w2, f"{w2}-b")
    for th in drivers:
        th.join(180)
    for wk, th in running.values():
        wk.request_stop()
        th.join(30)
    assert not errors, errors
    for w in (w1, w2):
        st = results[w]
        assert st[f"{w}-s0"][0] == "cancelled", st
        for i in (1, 2, 3):
            status, gen = st[f"{w}-s{i}"]
            assert status == "finished" and len(gen) == max_tokens, st
    # The restart hit live sessions, and the new consumer served the rest.
    assert steps_at_restart < max_tokens * 3
    assert int(cluster_client.hget(acct2, "steps") or 0) > steps_at_restart
    assert any(x.startswith(("state_lost", "rejected:unknown_session")) for x in statuses[w2]), statuses[w2]
    # Same prompts, same sampling: both workers produced the same tokens, restart or not.
    for i in (1, 2, 3):
        assert results[w1][f"{w1}-s{i}"][1] == results[w2][f"{w2}-s{i}"][1]
    # The control plane sees both workers' accounting.
    rollup(cluster_client)
    assert read_ledger(cluster_client, "acct-1").totals["generated_tokens"] >= 2 * 2 * max_tokens


def test_one_producer_drives_sessions_on_two_workers(redis_cluster: LocalCluster,  # noqa: F811
                                                     cluster_client: RedisCluster,  # noqa: F811
                                                     tiny_model_path: Path) -> None:
    """The Tracker's result reads are grouped per worker (one hash tag each): no CROSSSLOT."""
    from consumer.engines.reference import NumpyReferenceEngine
    from consumer.worker import Worker, WorkerSettings
    from producer import Producer
    from schemas import RouteHop, SessionSpec

    w1, w2 = two_workers_on_different_nodes(cluster_client)
    workers = []
    for w in (w1, w2):
        wk = Worker(NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=64),
                    RedisTransport(redis_cluster.client(), w, f"{w}-one"),  # type: ignore[arg-type]
                    WorkerSettings(worker_id=w, heartbeat_s=0.2))
        wk.start()
        th = threading.Thread(target=wk.run, daemon=True)
        th.start()
        workers.append((wk, th))
    try:
        prod = Producer(redis_cluster.client(), timeout_s=60)  # type: ignore[arg-type]
        specs = [(SessionSpec(session_id=f"one-{w}-{i}", account_id="a",
                              route=(RouteHop(worker_id=w, key=prod.discover(w).keys[0]),), max_tokens=6),
                  [7 + i, 8, 9]) for w in (w1, w2) for i in range(2)]
        hs = prod.run_many(specs)
        assert all(h.status == "finished" and len(h.generated) == 6 for h in hs.values())
        for i in range(2):
            assert hs[f"one-{w1}-{i}"].generated == hs[f"one-{w2}-{i}"].generated
    finally:
        for wk, th in workers:
            wk.request_stop()
            th.join(30)


def test_a_worker_refuses_a_cluster_with_one_primary_that_evicts(cluster_client: RedisCluster) -> None:  # noqa: F811
    """The memory policy is read on every primary (consumer/transport/memory.py): one that may evict is named."""
    from consumer.transport import EvictingRedis
    from consumer.transport.memory import eviction_policies

    c = cluster_client
    node = c.get_primaries()[1]
    policies = eviction_policies(c)
    assert policies is not None and set(policies.values()) == {"noeviction"} and len(policies) == 3
    c.get_redis_connection(node).config_set("maxmemory-policy", "volatile-lru")
    try:
        with pytest.raises(EvictingRedis, match=f"volatile-lru on {node.name}"):
            RedisTransport(c, "cw-evict").acquire_lease(wait=False)  # type: ignore[arg-type]
    finally:
        c.get_redis_connection(node).config_set("maxmemory-policy", "noeviction")


def test_forget_gone_on_a_cluster(cluster_client: RedisCluster) -> None:  # noqa: F811
    """`dgr ops forget-gone`'s one pipeline of every worker's state spans the nodes (consumer/ops/forget.py)."""
    from consumer.ops.forget import forget_gone
    from schemas.keys import WORKERS_INDEX

    c = cluster_client
    w1, w2 = two_workers_on_different_nodes(c)
    c.sadd(WORKERS_INDEX, w1, w2)
    c.set(WorkerKeys(w1).heartbeat, "{}", ex=60)
    assert {x.worker_id: x.status for x in forget_gone(c, 0)} == {w1: "up", w2: "noted"}  # type: ignore[arg-type]
    assert {x.worker_id: x.status for x in forget_gone(c, 0)} == {w1: "up", w2: "forgotten"}  # type: ignore[arg-type]
    assert c.smembers(WORKERS_INDEX) == {w1.encode()}
