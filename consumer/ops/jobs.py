"""RQ jobs of the control plane (queue `dgr-ops`): plain functions of where Redis is.

`rq worker dgr-ops` (the `ops` service in docker-compose.yml) runs them; `dgr ops enqueue-rollup`
and `rq cron consumer.ops.cron` enqueue them. RQ stays off the step path: it forks a work horse per
job, which suits a roll-up every minute, not a decode step every few milliseconds.

A job connects as every other dgr process does (consumer/connect.py: a URL, the master a Sentinel
group names, or a Cluster through `FailoverCluster`), from the RQ worker's own DGR_* variables (the
`dgr` options' variables: DGR_REDIS_URL, DGR_REDIS_SENTINEL, DGR_SENTINEL_MASTER, DGR_SENTINEL_USERNAME,
DGR_SENTINEL_PASSWORD, DGR_REDIS_CLUSTER). A job may name another deployment in its arguments
(`redis_url`, `cluster`, `sentinel`, `sentinel_master`); credentials of the sentinels always come from
the worker's environment, and an empty `redis_url` means the worker's own: that keeps passwords out of
job payloads (RQ stores a job's arguments in Redis and shows its description in `rq info`). Every job
returns a JSON-able dict (RQ keeps it as the job's result).

The queue itself lives on a plain Redis or a Sentinel-watched master (RQ has no Cluster support):
`rq worker -c consumer.ops.rq_settings` finds it from the same variables (consumer/ops/rq_settings.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from ..connect import RedisTarget, connect
from .common import Client, operator

QUEUE = "dgr-ops"


def job_target(redis_url: str = "", cluster: bool = False, sentinel: str = "", sentinel_master: str = "",
               environ: Any = None) -> RedisTarget:
    """Where a job works: the RQ worker's DGR_* variables, with what the job names in their place (a
    URL, a Cluster, sentinels and their master's name)."""
    env = os.environ if environ is None else environ
    if not (redis_url or sentinel or env.get("DGR_REDIS_URL") or env.get("DGR_REDIS_SENTINEL")):
        raise ValueError("the job names no Redis and neither DGR_REDIS_URL nor DGR_REDIS_SENTINEL is set "
                         "on the RQ worker")
    t = RedisTarget.from_env(env)
    change: dict[str, Any] = {}
    if redis_url:
        change |= {"url": redis_url, "cluster": cluster}
        if not sentinel:  # a URL of its own is the whole address unless the job names sentinels too
            change |= {"sentinel": "", "sentinel_master": ""}
    elif cluster:
        change["cluster"] = True
    if sentinel:
        change |= {"sentinel": sentinel, "sentinel_master": sentinel_master or t.sentinel_master}
    return dataclasses.replace(t, **change) if change else t


def _client(redis_url: str, cluster: bool, sentinel: str = "", sentinel_master: str = "") -> Client:
    return connect(job_target(redis_url, cluster, sentinel, sentinel_master))


def rollup_job(redis_url: str = "", cluster: bool = False, sentinel: str = "",
               sentinel_master: str = "") -> dict[str, Any]:
    """Fold every worker's per-account counters into the ledger (idempotent)."""
    from .rollup import rollup

    client = _client(redis_url, cluster, sentinel, sentinel_master)
    try:
        rep = rollup(client)
        return {k: v for k, v in rep.as_dict().items() if k != "folds"}
    finally:
        client.close()


def reap_job(redis_url: str = "", ttl_s: float = 3600.0, cluster: bool = False, dry_run: bool = False,
             sentinel: str = "", sentinel_master: str = "") -> dict[str, Any]:
    """Cancel sessions idle longer than ttl_s."""
    from .reaper import reap

    client = _client(redis_url, cluster, sentinel, sentinel_master)
    try:
        rows = reap(client, ttl_s, dry_run=dry_run, who=f"rq:{operator()}")
        hit = [x.as_dict() for x in rows if x.status in ("cancelled", "idle")]
        return {"looked_at": len(rows), "cancelled": sum(1 for x in rows if x.status == "cancelled"), "sessions": hit}
    finally:
        client.close()


def forget_job(redis_url: str = "", gone_for_s: float = 86_400.0, cluster: bool = False, dry_run: bool = False,
               sentinel: str = "", sentinel_master: str = "") -> dict[str, Any]:
    """Take workers gone for good out of the fleet index (consumer/ops/forget.py)."""
    from .forget import forget_gone

    client = _client(redis_url, cluster, sentinel, sentinel_master)
    try:
        rows = forget_gone(client, gone_for_s, dry_run=dry_run)
        return {"looked_at": len(rows), "forgotten": [x.worker_id for x in rows if x.status == "forgotten"],
                "kept": [x.as_dict() for x in rows if x.status not in ("up", "forgotten")]}
    finally:
        client.close()


def dlq_count_job(redis_url: str = "", cluster: bool = False, sentinel: str = "",
                  sentinel_master: str = "") -> dict[str, int]:
    """Dead letters per worker (a maintenance audit an alert can read from the job result)."""
    from .common import workers
    from .deadletters import dead_letter_count

    client = _client(redis_url, cluster, sentinel, sentinel_master)
    try:
        return {w: dead_letter_count(client, w) for w in workers(client)}
    finally:
        client.close()


def queue(queue_url: str, *, is_async: bool = True, connection: Any = None) -> Queue:
    """The `dgr-ops` queue on a plain Redis (`connection` overrides the URL: a Sentinel-watched master's
    client, or fakeredis in tests)."""
    conn = connection if connection is not None else redis.Redis.from_url(queue_url)
    return Queue(QUEUE, connection=conn, is_async=is_async)


def _where(redis_url: str, sentinel: str, sentinel_master: str) -> str:
    if sentinel:
        return f"sentinel master {sentinel_master or '$DGR_SENTINEL_MASTER'!r} via {sentinel}"
    return _redacted(redis_url) or "$DGR_REDIS_URL"


def enqueue_rollup(q: Queue, redis_url: str, cluster: bool = False, *, sentinel: str = "",
                   sentinel_master: str = "") -> Job:
    return q.enqueue(rollup_job, redis_url, cluster, sentinel, sentinel_master, job_timeout=600, result_ttl=86_400,
                     description=f"dgr rollup {_where(redis_url, sentinel, sentinel_master)}")


def enqueue_reap(q: Queue, redis_url: str, ttl_s: float, cluster: bool = False, *, sentinel: str = "",
                 sentinel_master: str = "") -> Job:
    where = _where(redis_url, sentinel, sentinel_master)
    return q.enqueue(reap_job, redis_url, ttl_s, cluster, False, sentinel, sentinel_master, job_timeout=600,
                     result_ttl=86_400, description=f"dgr reap ttl={ttl_s}s {where}")


def _redacted(url: str) -> str:
    """The URL without its password (job descriptions are visible in `rq info`)."""
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    if p.password is None:
        return url
    user = p.username or ""
    host = p.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
