"""Redis ACL users (docs/acl.md, consumer/ops/acl.py) on a private redis-server: a worker user cannot
touch another worker's keys (NOPERM) and still does its whole job through the URL; the producer
user drives sessions but cannot read accounting; the ops user runs the control plane and RQ."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from consumer.ops.acl import ops_rules, producer_rules, setuser, worker_rules
from consumer.ops.common import connect
from consumer.ops.deadletters import list_dead_letters
from consumer.ops.inspect import inspect_fleet
from consumer.ops.jobs import enqueue_rollup, queue
from consumer.ops.reaper import reap
from consumer.ops.rollup import read_ledger, rollup
from dgrtools.localredis import LocalRedis, find_redis_server
from schemas import WorkerKeys, job_from_fields, job_to_fields
from schemas.keys import WORKERS_INDEX
from tests.support import BurstWorker
from tests.test_ops_support import make_key, read_all, register, serve, step_job


@pytest.fixture(scope="module")
def acl_server() -> Iterator[LocalRedis]:
    if find_redis_server() is None:
        pytest.skip("redis-server not installed")
    with LocalRedis(appendonly=False) as server:
        admin = redis.Redis.from_url(server.url)
        for w in ("w1", "w2", "w3"):
            admin.execute_command(*setuser(f"dgr-worker-{w}", f"pw-{w}", worker_rules(w)))
        admin.execute_command(*setuser("dgr-tracker", "pw-tracker", producer_rules()))
        admin.execute_command(*setuser("dgr-ops", "pw-ops", ops_rules()))
        admin.execute_command("ACL", "SETUSER", "default", "off")  # from here on, only named users
        yield server


def url(server: LocalRedis, user: str, password: str) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{server.port}/0"


def test_no_anonymous_access(acl_server: LocalRedis) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(acl_server.url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url(acl_server, "dgr-worker-w1", "wrong")).ping()


def test_worker_user_does_its_job_on_its_own_keys_only(acl_server: LocalRedis) -> None:
    c1 = redis.Redis.from_url(url(acl_server, "dgr-worker-w1", "pw-w1"))
    c2 = redis.Redis.from_url(url(acl_server, "dgr-worker-w2", "pw-w2"))
    t1, t2 = register(c1, "w1"), register(c2, "w2")  # XGROUP CREATE, SET spec, SADD dgr:workers, SCRIPT LOAD
    # A completion through the EVALSHA script (XACK, SET NX, XADD, HINCRBY on session/account/worker).
    serve(t1, {"s1": ("acct-a", 0)})
    t1.recover_streams()
    t1.heartbeat({"busy_slots": 0})
    assert t1.cancellations()[0] == []
    assert set(t1.input_lag()) == set(t1.streams)
    assert c1.hget(t1.keys.worker_account, "steps") == b"1"

    w2 = WorkerKeys("w2")
    for cmd in (lambda: c1.get(w2.spec), lambda: c1.hgetall(w2.worker_account),
                lambda: c1.xadd(w2.cancellations, {"session_id": "x"}),
                lambda: c1.xreadgroup("dgr-workers", "evil", {t2.streams[0]: ">"}, count=1),
                lambda: c1.smembers(WORKERS_INDEX), lambda: c1.keys("*"), lambda: c1.flushall()):
        with pytest.raises(NoPermissionError):
            cmd()
    # The completion script pointed at another worker's keys is refused too (keys are checked in scripts).
    before = c2.hgetall(w2.worker_account)
    with pytest.raises(NoPermissionError):
        c1.evalsha(t1.io.scripts["complete"].sha, 7, w2.worker_account, w2.accounts_index, w2.dead_letters,
                   w2.lease, w2.lease_epoch, w2.tally, w2.call_guard,
                   "dgr-workers", 1, 1, 1, 1, "", "", 1, 1, 1, '{"records":[],"call":["decode",1,1,"0.1"]}')
    assert c2.hgetall(w2.worker_account) == before


def test_producer_user_drives_sessions_but_reads_no_accounting(acl_server: LocalRedis) -> None:
    admin_w1 = redis.Redis.from_url(url(acl_server, "dgr-worker-w1", "pw-w1"))
    t1 = register(admin_w1, "w1")
    read_all(t1)  # drain what earlier tests left
    p = redis.Redis.from_url(url(acl_server, "dgr-tracker", "pw-tracker"))
    from producer import Producer

    prod = Producer(p)
    assert {w.worker_id for w in prod.workers()} >= {"w1", "w2"}
    from schemas.prefix import PrefixSummary

    t1.heartbeat({"slots": 4}, PrefixSummary.of(16, "account", ["ab" * 16]))
    (w1,) = [w for w in prod.workers() if w.worker_id == "w1"]  # the summary's own key, read as the Tracker
    assert w1.heartbeat["prefix"]["ids"] == ["ab" * 16]
    info = prod.discover("w1")
    assert info.alive and make_key("prefill").digest in info.digests
    job = step_job("ps1", 1, worker="w1")
    p.xadd(WorkerKeys("w1").input_stream(make_key("decode").digest, "decode"), job_to_fields(job))  # type: ignore[arg-type]
    (d,) = read_all(t1)
    assert job_from_fields(d.fields) == job
    admin_w1.xack(d.stream, "dgr-workers", d.entry_id)
    prod.cancel("w1", "ps1")
    assert "ps1" in t1.cancellations()[0]
    assert prod.cancelled("w1", "ps1")  # the cancel marker: the Tracker may set and read it
    dec = WorkerKeys("w1").input_stream(make_key("decode").digest, "decode")
    with pytest.raises(NoPermissionError):
        p.set(dec, "clobbered")  # ...but SET only there: never over a stream
    assert p.xread({WorkerKeys("w1").results("s1"): "0"}, count=1)  # results of any session
    for cmd in (lambda: p.hgetall(WorkerKeys("w1").worker_account), lambda: p.get(WorkerKeys("w1").result_record("x")),
                lambda: p.xrange(WorkerKeys("w1").dead_letters), lambda: p.delete(WorkerKeys("w1").spec),
                lambda: p.xadd(WorkerKeys("w1").results("s1"), {"forged": "1"})):
        with pytest.raises(NoPermissionError):
            cmd()


def test_producer_user_relays_activation_blobs_and_nothing_more(acl_server: LocalRedis) -> None:
    """A route's relay (docs/routes.md): GET + DEL of a hop's output blob, SET of the next hop's input blob."""
    w1 = redis.Redis.from_url(url(acl_server, "dgr-worker-w1", "pw-w1"))
    p = redis.Redis.from_url(url(acl_server, "dgr-tracker", "pw-tracker"))
    out_k, in_k = WorkerKeys("w1").activations_out("j1"), WorkerKeys("w2").activations_in("j2")
    w1.set(out_k, b"rows", ex=60)  # the hop's completion writes it (as the worker user)
    assert p.get(out_k) == b"rows"
    assert p.set(in_k, b"rows", ex=60)
    assert p.delete(out_k) == 1
    for cmd in (lambda: p.set(out_k, b"forged"), lambda: p.get(in_k), lambda: p.delete(in_k),
                lambda: p.set(WorkerKeys("w1").result_record("x"), b"forged")):
        with pytest.raises(NoPermissionError):
            cmd()


def test_ops_user_runs_the_control_plane_and_rq(acl_server: LocalRedis) -> None:
    ops_url = url(acl_server, "dgr-ops", "pw-ops")
    c = connect(ops_url)
    assert isinstance(c, redis.Redis)
    w1 = redis.Redis.from_url(url(acl_server, "dgr-worker-w1", "pw-w1"))
    serve(register(w1, "w1"), {"s2": ("acct-b", 0)})
    assert rollup(c).count("regressed") == 0
    assert read_ledger(c, "acct-b").totals["steps"] == 1
    assert {r.worker_id for r in inspect_fleet(c)} >= {"w1", "w2"}
    list_dead_letters(c)
    reap(c, 3600, dry_run=True)
    q = queue(ops_url)
    job = enqueue_rollup(q, ops_url)
    BurstWorker([q], connection=q.connection).work(burst=True)
    job.refresh()
    assert job.get_status() == "finished", job.latest_result()
    assert json.dumps(job.return_value())
    with pytest.raises(NoPermissionError):
        c.flushall()


def test_a_real_worker_and_producer_under_acl_users(acl_server: LocalRedis, tiny_model_path: Path) -> None:
    """The whole loop with least-privilege users: Worker (dgr-worker-w3) + Producer (dgr-tracker),
    then a roll-up and `inspect` as dgr-ops."""
    from consumer.engines.reference import NumpyReferenceEngine
    from consumer.transport import RedisTransport
    from consumer.worker import Worker, WorkerSettings
    from producer import Producer
    from schemas import RouteHop, SessionSpec

    wc = redis.Redis.from_url(url(acl_server, "dgr-worker-w3", "pw-w3"))
    eng = NumpyReferenceEngine(tiny_model_path, n_slots=2, ctx_per_session=64)
    worker = Worker(eng, RedisTransport(wc, "w3", "w3-c"), WorkerSettings(worker_id="w3"))
    worker.start()
    th = threading.Thread(target=worker.run, daemon=True)
    th.start()
    try:
        prod = Producer(redis.Redis.from_url(url(acl_server, "dgr-tracker", "pw-tracker")), timeout_s=30)
        key = prod.discover("w3").keys[0]
        specs = [(SessionSpec(session_id=f"acl-{i}", account_id="acct-acl", route=(RouteHop(worker_id="w3", key=key),),
                              max_tokens=4), [3, 4 + i]) for i in range(2)]
        hs = prod.run_many(specs)
        assert {h.status for h in hs.values()} == {"finished"}
    finally:
        worker.request_stop()
        th.join(30)
    ops = connect(url(acl_server, "dgr-ops", "pw-ops"))
    rollup(ops, worker_ids=["w3"])
    assert read_ledger(ops, "acct-acl").totals["generated_tokens"] == 8
    (rep,) = inspect_fleet(ops, ["w3"])
    assert rep.accounting["steps"] >= 2 and rep.dead_letters == 0


def test_printed_acl_lines_paste_into_redis_cli() -> None:
    """What `dgr ops acl ...` prints is a valid shell + redis-cli line."""
    import shutil
    import subprocess

    from typer.testing import CliRunner

    from tests.test_inspect import make_app

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not installed")
    with LocalRedis(appendonly=False) as server:
        for args in (["worker", "-w", "gpu-0"], ["producer"], ["ops"]):
            line = CliRunner().invoke(make_app(), ["ops", "acl", *args, "--password", "s3cret"]).output.strip()
            out = subprocess.run(["bash", "-c", f"redis-cli -p {server.port} {line}"], capture_output=True, text=True)
            assert out.stdout.strip() == "OK", (line, out.stdout, out.stderr)
        rules = redis.Redis.from_url(server.url).acl_getuser("dgr-worker-gpu-0")
        assert "~dgr:{gpu-0}:*" in rules["keys"] or "~dgr:{gpu-0}:*" in str(rules)
