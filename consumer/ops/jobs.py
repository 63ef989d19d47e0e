"""RQ jobs of the control plane (queue `dgr-ops`): plain functions of a Redis URL.

`rq worker dgr-ops` (the `ops` service in docker-compose.yml) runs them; `dgr ops enqueue-rollup`
and `rq cron consumer.ops.cron` enqueue them. RQ stays off the step path: it forks a work horse per
job, which suits a roll-up every minute, not a decode step every few milliseconds.

The queue lives on a plain Redis (RQ has no Cluster support). The job's `redis_url` may point at a
Cluster (`cluster=True`): the jobs themselves are cluster-safe. An empty `redis_url` means the RQ
worker's own `DGR_REDIS_URL`: that keeps passwords out of job payloads (RQ stores a job's arguments
in Redis and shows its description in `rq info`). Every job returns a JSON-able dict (RQ keeps it
as the job's result).
"""

from __future__ import annotations

import os
from typing import Any

import redis
from rq import Queue
from rq.job import Job

from .common import Client, connect, env_cluster, operator

QUEUE = "dgr-ops"


def _client(redis_url: str, cluster: bool) -> Client:
    url = redis_url or os.environ.get("DGR_REDIS_URL", "")
    if not url:
        raise ValueError("no redis_url given and DGR_REDIS_URL is not set on the RQ worker")
    return connect(url, cluster=cluster or env_cluster())


def rollup_job(redis_url: str = "", cluster: bool = False) -> dict[str, Any]:
    """Fold every worker's per-account counters into the ledger (idempotent)."""
    from .rollup import rollup

    client = _client(redis_url, cluster)
    try:
        rep = rollup(client)
        return {k: v for k, v in rep.as_dict().items() if k != "folds"}
    finally:
        client.close()


def reap_job(redis_url: str = "", ttl_s: float = 3600.0, cluster: bool = False,
             dry_run: bool = False) -> dict[str, Any]:
    """Cancel sessions idle longer than ttl_s."""
    from .reaper import reap

    client = _client(redis_url, cluster)
    try:
        rows = reap(client, ttl_s, dry_run=dry_run, who=f"rq:{operator()}")
        hit = [x.as_dict() for x in rows if x.status in ("cancelled", "idle")]
        return {"looked_at": len(rows), "cancelled": sum(1 for x in rows if x.status == "cancelled"), "sessions": hit}
    finally:
        client.close()


def dlq_count_job(redis_url: str = "", cluster: bool = False) -> dict[str, int]:
    """Dead letters per worker (a maintenance audit an alert can read from the job result)."""
    from .common import workers
    from .deadletters import dead_letter_count

    client = _client(redis_url, cluster)
    try:
        return {w: dead_letter_count(client, w) for w in workers(client)}
    finally:
        client.close()


def queue(queue_url: str, *, is_async: bool = True, connection: Any = None) -> Queue:
    """The `dgr-ops` queue on a plain Redis (`connection` overrides the URL: tests pass fakeredis)."""
    conn = connection if connection is not None else redis.Redis.from_url(queue_url)
    return Queue(QUEUE, connection=conn, is_async=is_async)


def enqueue_rollup(q: Queue, redis_url: str, cluster: bool = False) -> Job:
    return q.enqueue(rollup_job, redis_url, cluster, job_timeout=600, result_ttl=86_400,
                     description=f"dgr rollup {_redacted(redis_url) or '$DGR_REDIS_URL'}")


def enqueue_reap(q: Queue, redis_url: str, ttl_s: float, cluster: bool = False) -> Job:
    return q.enqueue(reap_job, redis_url, ttl_s, cluster, job_timeout=600, result_ttl=86_400,
                     description=f"dgr reap ttl={ttl_s}s {_redacted(redis_url) or '$DGR_REDIS_URL'}")


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
