"""RQ's settings for the `dgr-ops` queue: `rq worker -c consumer.ops.rq_settings dgr-ops` (and `rq cron
-c ...`) find the queue's Redis from the same DGR_* variables as every dgr process (consumer/connect.py):

* DGR_OPS_QUEUE_URL set: the queue is on that plain Redis (`REDIS_URL`);
* else DGR_REDIS_SENTINEL + DGR_SENTINEL_MASTER: the master the sentinels name (RQ's `SENTINEL`
  settings, built by consumer/connect.py's `sentinel_settings`: the URL's user, password, db and TLS for
  the master, DGR_SENTINEL_USERNAME / DGR_SENTINEL_PASSWORD for the sentinels), so the queue follows a
  failover as the jobs do;
* else DGR_REDIS_URL (`REDIS_URL`).

RQ has no Redis Cluster support: with DGR_REDIS_CLUSTER set and no DGR_OPS_QUEUE_URL this module refuses
to load (the queue must live on a plain Redis beside the Cluster).
"""

from __future__ import annotations

import os
from typing import Any

from ..connect import RedisTarget, sentinel_settings


def settings(environ: Any = None) -> dict[str, Any]:
    """RQ's connection settings (`REDIS_URL` or `SENTINEL`) from the environment."""
    env = os.environ if environ is None else environ
    queue_url = env.get("DGR_OPS_QUEUE_URL", "")
    if queue_url:
        return {"REDIS_URL": queue_url}
    target = RedisTarget.from_env(env)
    if target.cluster:
        raise RuntimeError("RQ has no Redis Cluster support: set DGR_OPS_QUEUE_URL to a plain Redis for the "
                           "dgr-ops queue (the jobs still work on the Cluster)")
    if not target.sentinel:
        return {"REDIS_URL": target.url}
    master_kw, sentinel_kw = sentinel_settings(target)
    # RQ passes db, username, password, socket_timeout and ssl itself, then CONNECTION_KWARGS over them.
    return {"SENTINEL": {"INSTANCES": target.sentinels, "MASTER_NAME": target.sentinel_master,
                         "DB": master_kw.get("db", 0), "SSL": bool(master_kw.pop("ssl", False)),
                         "CONNECTION_KWARGS": master_kw, "SENTINEL_KWARGS": sentinel_kw}}


globals().update(settings())
