"""`rq cron consumer.ops.cron`: the control plane's schedule (the `ops-cron` compose service).

DGR_ROLLUP_INTERVAL_S (default 60): accounting roll-up every so often (0: off).
DGR_REAP_TTL_S (default 0: off) and DGR_REAP_INTERVAL_S (default 60): the idle-session reaper.
DGR_FORGET_AFTER_S (default 0: off) and DGR_FORGET_INTERVAL_S (default 3600): workers gone that long taken out of
the fleet index (consumer/ops/forget.py).
The jobs run on `rq worker dgr-ops` with that worker's DGR_REDIS_URL (no URL travels in the job).
"""

from __future__ import annotations

import os

from rq import cron

from .jobs import QUEUE, forget_job, reap_job, rollup_job


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    return float(raw) if raw else default


ROLLUP_INTERVAL_S = int(_env_float("DGR_ROLLUP_INTERVAL_S", 60))
REAP_TTL_S = _env_float("DGR_REAP_TTL_S", 0)
REAP_INTERVAL_S = int(_env_float("DGR_REAP_INTERVAL_S", 60))
FORGET_AFTER_S = _env_float("DGR_FORGET_AFTER_S", 0)
FORGET_INTERVAL_S = int(_env_float("DGR_FORGET_INTERVAL_S", 3600))

if ROLLUP_INTERVAL_S > 0:
    cron.register(rollup_job, QUEUE, interval=ROLLUP_INTERVAL_S, job_timeout=600, name="dgr-rollup")
if REAP_TTL_S > 0:
    cron.register(reap_job, QUEUE, kwargs={"ttl_s": REAP_TTL_S}, interval=REAP_INTERVAL_S, job_timeout=600,
                  name="dgr-reap")
if FORGET_AFTER_S > 0:
    cron.register(forget_job, QUEUE, kwargs={"gone_for_s": FORGET_AFTER_S}, interval=FORGET_INTERVAL_S,
                  job_timeout=600, name="dgr-forget")
