"""The RQ side: the `rq cron` schedule module, the compose services, jobs through a real queue."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import fakeredis
import pytest
import redis
import yaml
from rq.cron import CronScheduler
from typer.testing import CliRunner

from consumer.cli import app
from consumer.connect import RedisTarget
from consumer.ops.jobs import (
    QUEUE,
    dlq_count_job,
    enqueue_reap,
    enqueue_rollup,
    job_target,
    queue,
    reap_job,
    rollup_job,
)
from consumer.ops.rollup import read_ledger
from consumer.ops.rq_settings import settings
from dgrtools.localredis import LocalRedis
from tests.fixtures.sentinel import SentinelGroup, sentinel_group  # noqa: F401 (fixture)
from tests.support import BurstWorker
from tests.test_ops_support import register, serve

ROOT = Path(__file__).resolve().parents[1]


def load_cron(monkeypatch: pytest.MonkeyPatch, **env: str) -> CronScheduler:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop("consumer.ops.cron", None)
    cron = CronScheduler(connection=fakeredis.FakeRedis())
    cron.load_config_from_file("consumer.ops.cron")
    return cron


def test_cron_schedule_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = {j.name: j for j in load_cron(monkeypatch, DGR_ROLLUP_INTERVAL_S="30", DGR_REAP_TTL_S="600").get_jobs()}
    assert set(jobs) == {"dgr-rollup", "dgr-reap"}
    assert jobs["dgr-rollup"].func is rollup_job and jobs["dgr-rollup"].interval == 30
    assert jobs["dgr-reap"].func is reap_job and jobs["dgr-reap"].kwargs == {"ttl_s": 600.0}
    assert all(j.queue_name == QUEUE for j in jobs.values())
    monkeypatch.delenv("DGR_REAP_TTL_S")
    assert [j.name for j in load_cron(monkeypatch).get_jobs()] == ["dgr-rollup"]
    importlib.import_module("consumer.ops.cron")


def test_compose_runs_the_ops_queue_and_schedule() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ops, cron = services["ops"], services["ops-cron"]
    assert ops["entrypoint"][:2] == ["rq", "worker"] and QUEUE in ops["entrypoint"]
    settings = ["-c", "consumer.ops.rq_settings"]  # the queue found from the DGR_* variables, as the jobs
    assert ops["entrypoint"][2:4] == settings and "RQ_REDIS_URL" not in ops["environment"]
    assert cron["entrypoint"] == ["rq", "cron", *settings, "consumer.ops.cron"]
    assert ops["environment"]["DGR_REDIS_URL"] == cron["environment"]["DGR_REDIS_URL"]
    for svc in (ops, cron):
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_jobs_through_a_real_queue_and_worker(redis_server: LocalRedis, real_redis: redis.Redis,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What `rq worker dgr-ops` does, in-process (rq's SimpleWorker: no fork), with the URL from its env."""
    monkeypatch.setenv("DGR_REDIS_URL", redis_server.url)
    t = register(real_redis, "w1")
    serve(t, {"s1": ("acct-a", 0)})
    q = queue(redis_server.url)
    q.empty()  # only this test's jobs (the server is shared by the session's tests)
    j1 = enqueue_rollup(q, "")  # no URL in the job: the worker's DGR_REDIS_URL
    j2 = enqueue_reap(q, "", 3600)
    assert "$DGR_REDIS_URL" in (j1.description or "")
    BurstWorker([q], connection=q.connection).work(burst=True)
    assert (j1.return_value() or {})["folded"] == 1 and (j2.return_value() or {})["cancelled"] == 0
    assert read_ledger(real_redis, "acct-a").totals["steps"] == 1


# ------------------------------------------------------------------ the jobs connect as everything else


def test_a_job_connects_from_the_workers_variables_and_its_own_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = {"DGR_REDIS_URL": "redis://u:pw@unused:1/3", "DGR_REDIS_SENTINEL": "s1:1,s2:2", "DGR_SENTINEL_MASTER": "m",
            "DGR_SENTINEL_PASSWORD": "spw"}
    assert job_target(environ=sent) == RedisTarget(url="redis://u:pw@unused:1/3", sentinel="s1:1,s2:2",
                                                   sentinel_master="m", sentinel_password="spw")
    # the job's own URL is the whole address; its own sentinels keep the worker's credentials
    assert job_target("redis://h:2/0", environ=sent) == RedisTarget(url="redis://h:2/0", sentinel_password="spw")
    assert job_target(sentinel="t:9", sentinel_master="n", environ=sent).sentinel_password == "spw"
    assert job_target(sentinel="t:9", environ=sent).sentinel_master == "m"
    assert job_target(environ={"DGR_REDIS_URL": "redis://h:1/0", "DGR_REDIS_CLUSTER": "1"}).cluster
    assert job_target("redis://h:1/0", True, environ={}).cluster
    with pytest.raises(ValueError, match="DGR_REDIS_URL"):
        job_target(environ={})
    # every job goes through consumer/connect.py with that target (a Cluster: FailoverCluster)
    import consumer.ops.jobs as jobs

    seen: list[RedisTarget] = []

    def fake_connect(t: RedisTarget) -> fakeredis.FakeRedis:
        seen.append(t)
        return fakeredis.FakeRedis()

    monkeypatch.setattr(jobs, "connect", fake_connect)
    for k, v in sent.items():
        monkeypatch.setenv(k, v)
    rollup_job()
    reap_job(ttl_s=60)
    dlq_count_job()
    assert seen == [job_target(environ=sent)] * 3


def test_rq_settings_name_the_queue_from_the_same_variables() -> None:
    assert settings({"DGR_REDIS_URL": "redis://h:1/2"}) == {"REDIS_URL": "redis://h:1/2"}
    assert settings({"DGR_OPS_QUEUE_URL": "redis://q:1/0", "DGR_REDIS_CLUSTER": "1"}) == {"REDIS_URL": "redis://q:1/0"}
    with pytest.raises(RuntimeError, match="Cluster"):
        settings({"DGR_REDIS_URL": "redis://h:1/0", "DGR_REDIS_CLUSTER": "1"})
    got = settings({"DGR_REDIS_URL": "rediss://u:pw@unused:1/4?ssl_cert_reqs=none", "DGR_REDIS_SENTINEL": "a:1,b:2",
                    "DGR_SENTINEL_MASTER": "m", "DGR_SENTINEL_PASSWORD": "spw"})["SENTINEL"]
    assert got["INSTANCES"] == [("a", 1), ("b", 2)] and got["MASTER_NAME"] == "m" and got["DB"] == 4 and got["SSL"]
    assert got["CONNECTION_KWARGS"]["username"] == "u" and got["CONNECTION_KWARGS"]["password"] == "pw"
    assert got["SENTINEL_KWARGS"]["password"] == "spw" and got["SENTINEL_KWARGS"]["ssl"]


def test_queue_and_jobs_follow_a_sentinel_group(sentinel_group: SentinelGroup, tmp_path: Path,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An RQ worker with only DGR_REDIS_SENTINEL / DGR_SENTINEL_MASTER (its URL's host a dead port): RQ's
    settings module finds the queue on the master the sentinels name, and the jobs roll that master up;
    `dgr ops enqueue-rollup` with the Sentinel options does the same, here (--sync) and through the queue."""
    g = sentinel_group
    t = g.target("redis://127.0.0.1:1/0")
    master = g.node(g.master_port())
    w = register(master, "w1")
    serve(w, {"s1": ("acct-a", 0)})
    env = t.env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("DGR_OPS_QUEUE_URL", raising=False)
    from rq.cli.helpers import get_redis_from_config

    conn = get_redis_from_config(settings())  # what `rq worker -c consumer.ops.rq_settings` connects to
    assert conn.info("replication")["role"] == "master" and conn.connection_pool.connection_kwargs["db"] == 0
    q = queue("", connection=conn)
    job = enqueue_rollup(q, "")
    BurstWorker([q], connection=conn).work(burst=True)
    assert (job.return_value() or {})["folded"] == 1, job.exc_info
    assert read_ledger(master, "acct-a").totals["steps"] == 1
    for k in env:  # the CLI, from its options alone
        monkeypatch.delenv(k)
    opts = ["--redis-url", t.url, "--redis-sentinel", t.sentinel, "--sentinel-master", t.sentinel_master]
    res = CliRunner().invoke(app, ["ops", "enqueue-rollup", "--sync", *opts])
    assert res.exit_code == 0 and "finished" in res.output, res.output
    assert "DGR_REDIS_SENTINEL" not in os.environ  # the options were the job's environment for the run only
    res = CliRunner().invoke(app, ["ops", "enqueue-rollup", *opts])
    assert res.exit_code == 0 and "on dgr-ops" in res.output, res.output
    assert master.llen("rq:queue:dgr-ops") == 1
    res = CliRunner().invoke(app, ["ops", "enqueue-rollup", "--cluster", "--redis-url", "redis://h:1/0"])
    assert res.exit_code == 2 and "queue-url" in res.output, res.output
