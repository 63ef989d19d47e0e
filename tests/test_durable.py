"""Durable completions (`--durable-replicas`, consumer/transport/durable.py) against a real master and
replica the test starts: a completion counts only once the replica has it; too few replicas in time is
ridden through as an outage and the call re-sent, which the call guard keeps exactly-once; a stop ends the
wait; a Cluster sends the WAIT to the node of the worker's slot (DGR_SOAK=1)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from consumer.config import TransportSettings
from consumer.transport import NotDurable, RedisTransport, Stopping
from dgrtools.localredis import LocalRedis
from schemas import Accounting, Status, StepResult, WorkerKeys, job_from_fields

from .chaos_support import SOAK
from .fixtures.cluster import LocalCluster, need
from .fixtures.sentinel import wait_until
from .test_ops_support import make_key, push, read_all, step_job
from .transport_support import Completion, complete_entries

pytestmark = pytest.mark.timeout(120)
FAST = {"durable_timeout_ms": 50, "retry_base_s": 0.01, "retry_cap_s": 0.05, "outage_max_s": 30.0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRedis, LocalRedis]]:
    need("redis-server")
    root = tmp_path_factory.mktemp("durable")
    master = LocalRedis(data_dir=root / "master", appendonly=False,
                        extra_args=("--repl-diskless-sync-delay", "0")).start()
    replica = LocalRedis(data_dir=root / "replica", appendonly=False,
                         extra_args=("--replicaof", "127.0.0.1", str(master.port))).start()
    try:
        wait_until(lambda: redis.Redis(port=replica.port).info("replication")["master_link_status"] == "up", 30,
                   "the replica to sync")
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def clients(pair: tuple[LocalRedis, LocalRedis]) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    master, replica = pair
    m, r = redis.Redis.from_url(master.url), redis.Redis.from_url(replica.url)
    m.flushall()
    yield m, r
    m.flushall()
    m.close()
    r.close()


def transport(client: Any, worker: str, **settings: Any) -> RedisTransport:
    t = RedisTransport(client, worker, consumer_name=worker, settings=TransportSettings(**{**FAST, **settings}))
    t.acquire_lease(wait=False)  # the call guard is on with a lease
    t.register([make_key("prefill"), make_key("decode")], {"slots": 4})
    return t


def one_step(t: RedisTransport, session: str, pos: int) -> list[Completion]:
    """Push and read step `pos` of a session (account acct-1); its answer, not filed yet."""
    push(t.client, t.worker_id, [step_job(session, pos, worker=t.worker_id)])
    (d,) = read_all(t)
    job = job_from_fields(d.fields)
    res = StepResult(job_id=job.job_id, session_id=session, status=Status.OK, position=job.end_position, token=7,
                     accounting=Accounting(prompt_tokens=len(job.tokens) if job.phase == "prefill" else 0,
                                           generated_tokens=1, engine_seconds=0.01),
                     worker_id=t.worker_id, batch_size=1)
    return [Completion(d, res, "acct-1", d.phase)]


def results_on(client: redis.Redis, worker: str, session: str) -> int:
    return int(client.xlen(WorkerKeys(worker).results(session)))


def test_a_completion_is_on_the_replica_when_it_returns(clients: tuple[redis.Redis, redis.Redis]) -> None:
    m, r = clients
    t = transport(m, "dur-1", durable_replicas=1)
    for pos in range(20):
        assert complete_entries(t, one_step(t, "s1", pos)) == [True]
        assert results_on(r, "dur-1", "s1") == pos + 1  # read from the replica at once: WAIT made it so
    assert r.hget(WorkerKeys("dur-1").worker_account, "generated_tokens") == b"20"  # each counted once
    assert transport(m, "dur-off").publisher.durable is None  # off by default


def test_too_few_replicas_is_an_outage_and_the_re_send_files_nothing_twice(
        pair: tuple[LocalRedis, LocalRedis], clients: tuple[redis.Redis, redis.Redis]) -> None:
    """The replica stops (SIGSTOP) while a completion is filed: the call does not return; each try is a
    shortfall, re-sent; once the replica is back the call returns, filed once."""
    m, r = clients
    replica = pair[1]
    t = transport(m, "dur-2", durable_replicas=1)
    comps = one_step(t, "s1", 0)
    done: list[list[bool]] = []
    assert replica.proc is not None
    replica.proc.send_signal(signal.SIGSTOP)
    try:
        th = threading.Thread(target=lambda: done.append(complete_entries(t, comps)), daemon=True)
        th.start()
        time.sleep(0.5)
        assert not done, "the completion counted before the replica had it"
        assert t.publisher.durable is not None and t.publisher.durable.shortfalls >= 2
    finally:
        replica.proc.send_signal(signal.SIGCONT)
    th.join(30)
    assert done == [[True]], done  # the first send's reply: the re-sends were refused whole (DUP)
    keys = WorkerKeys("dur-2")
    assert results_on(r, "dur-2", "s1") == 1
    assert int(r.hget(keys.worker_account, "durable_resends") or 0) >= 2
    assert r.hget(keys.worker_account, "prompt_tokens") == b"3" and r.hget(keys.worker_account, "steps") == b"1"
    assert t.outages == 1  # ridden through as one outage, logged as such


def test_a_re_send_on_a_new_connection_still_waits_for_the_first_filing(
        clients: tuple[redis.Redis, redis.Redis], monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply of the first send is lost (the connection drops after Redis ran the pipeline): the re-send
    is refused by the call guard ('DUP', nothing written) and makes its own write before WAIT, so the
    WAIT covers the first filing however the connection changed."""
    m, r = clients
    t = transport(m, "dur-3", durable_replicas=1)
    comps = one_step(t, "s1", 0)
    real = redis.client.Pipeline.execute
    lost: list[int] = []

    def execute(self: Any, raise_on_error: bool = True) -> Any:
        script = any(c[0][0] == "EVALSHA" for c in self.command_stack)
        out = real(self, raise_on_error)
        if script and not lost:
            lost.append(1)
            self.connection_pool.disconnect()  # the next try gets a new connection
            raise redis.ConnectionError("reply lost")
        return out

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    assert complete_entries(t, comps) == [False]  # 'DUP': filed by the first send
    assert lost == [1]
    assert results_on(r, "dur-3", "s1") == 1 and r.hget(WorkerKeys("dur-3").worker_account, "steps") == b"1"
    assert r.hget(WorkerKeys("dur-3").worker_account, "durable_resends") == b"1"  # the re-send's own write


def test_more_replicas_than_there_are_gives_up_after_the_outage_limit(clients: tuple[redis.Redis, redis.Redis]
                                                                      ) -> None:
    m, _ = clients
    t = transport(m, "dur-4", durable_replicas=2, outage_max_s=0.4)
    comps = one_step(t, "s1", 0)
    t0 = time.monotonic()
    with pytest.raises(NotDurable, match="1 of 2 replicas"):
        complete_entries(t, comps)
    assert time.monotonic() - t0 < 5
    assert results_on(m, "dur-4", "s1") == 1  # filed once on the master, however often it was re-sent


def test_a_stop_ends_the_wait_for_replicas(clients: tuple[redis.Redis, redis.Redis]) -> None:
    m, _ = clients
    t = transport(m, "dur-5", durable_replicas=2, durable_timeout_ms=200)
    comps = one_step(t, "s1", 0)
    threading.Timer(0.3, t.request_stop).start()
    t0 = time.monotonic()
    with pytest.raises(Stopping):
        complete_entries(t, comps)
    assert time.monotonic() - t0 < 1.5  # the stop, then at most the WAIT in flight (200 ms)


def test_settings_refuse_a_wait_without_a_timeout(clients: tuple[redis.Redis, redis.Redis]) -> None:
    with pytest.raises(ValueError, match="timeout"):
        transport(clients[0], "dur-6", durable_replicas=1, durable_timeout_ms=0)


def test_the_benchmark_times_both_settings(tmp_path: Path) -> None:
    """`dgr bench durable` (docs/benchmarks.md has its figures), in small."""
    from dgrtools.bench.durable import run

    need("redis-server")
    runs = run(tmp_path, sessions=(2,), calls=20, block=10, warmup=2)
    assert [(r.setting, r.calls) for r in runs] == [("off", 20), ("wait 1", 20)]
    assert runs[0].added_us is None and runs[1].added_us is not None and runs[1].median_us > 0
    assert (tmp_path / "durable.json").exists()


@pytest.mark.skipif(not SOAK, reason="DGR_SOAK=1: a 3+3 Redis Cluster")
def test_on_a_cluster_the_wait_goes_to_the_node_of_the_workers_slot(tmp_path: Path) -> None:
    need("redis-server", "redis-cli")
    cluster = LocalCluster(n=6, replicas=1).start()
    try:
        from consumer.connect import FailoverCluster

        c = FailoverCluster.from_url(cluster.url)
        t = transport(c, "dur-c", durable_replicas=1)
        master = c.get_node_from_key(t.keys.base).port
        (port,) = [p for p in cluster.ports
                   if redis.Redis(port=p).info("replication").get("master_port") == master]
        replica = redis.Redis(port=port, single_connection_client=True)
        replica.execute_command("READONLY")  # reads of the slot on its replica
        for pos in range(5):
            assert complete_entries(t, one_step(t, "s1", pos)) == [True]
            assert results_on(replica, "dur-c", "s1") == pos + 1  # the master's replica has it on return
        c.close()
    finally:
        cluster.stop()
