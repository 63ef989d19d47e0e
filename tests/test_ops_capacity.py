"""`dgr ops capacity` runs the real step-path commands against a Redis and cleans up after itself."""

from __future__ import annotations

import redis

from consumer.ops.capacity import measure
from dgrtools.localredis import LocalRedis


def test_capacity_measures_and_cleans_up(redis_server: LocalRedis, real_redis: redis.Redis) -> None:
    res = measure(redis_server.url, clients=1, batch=4, seconds=0.5)
    assert res.steps > 0 and res.steps % 4 == 0 and res.cycles == res.steps // 4
    assert res.redis_cpu_us_per_step > 0 and res.evalsha_us_per_step > 0 and res.one_core_steps_per_s > 0
    assert res.redis_version.startswith("7")
    assert real_redis.dbsize() == 0
