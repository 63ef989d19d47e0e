"""The RQ side: the `rq cron` schedule module, the compose services, jobs through a real queue."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import fakeredis
import pytest
import redis
import yaml
from rq import SimpleWorker
from rq.cron import CronScheduler

from consumer.ops.jobs import QUEUE, enqueue_reap, enqueue_rollup, queue, reap_job, rollup_job
from consumer.ops.rollup import read_ledger
from dgrtools.localredis import LocalRedis
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
    assert ops["environment"]["DGR_REDIS_URL"] == ops["environment"]["RQ_REDIS_URL"]
    assert cron["entrypoint"] == ["rq", "cron", "consumer.ops.cron"]
    for svc in (ops, cron):
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_jobs_through_a_real_queue_and_worker(redis_server: LocalRedis, real_redis: redis.Redis,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What `rq worker dgr-ops` does, in-process (SimpleWorker: no fork), with the URL from its env."""
    monkeypatch.setenv("DGR_REDIS_URL", redis_server.url)
    t = register(real_redis, "w1")
    serve(t, {"s1": ("acct-a", 0)})
    q = queue(redis_server.url)
    j1 = enqueue_rollup(q, "")  # no URL in the job: the worker's DGR_REDIS_URL
    j2 = enqueue_reap(q, "", 3600)
    assert "$DGR_REDIS_URL" in (j1.description or "")
    SimpleWorker([q], connection=q.connection).work(burst=True)
    assert (j1.return_value() or {})["folded"] == 1 and (j2.return_value() or {})["cancelled"] == 0
    assert read_ledger(real_redis, "acct-a").totals["steps"] == 1
