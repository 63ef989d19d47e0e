"""schemas/lag.py: the one reading of a stream's lag (producer backpressure, worker metric, dgr inspect)."""

from __future__ import annotations

import redis

from schemas.keys import GROUP
from schemas.lag import stream_lag


def test_lag_of_the_worker_group() -> None:
    groups = [{"name": b"other", "lag": 1}, {"name": GROUP.encode(), "lag": 3, "pending": 2}]
    sl = stream_lag(10, groups)
    assert (sl.length, sl.lag, sl.behind) == (10, 3, 3)
    assert sl.group is not None and sl.group["pending"] == 2


def test_no_group_or_no_stream_counts_the_whole_length() -> None:
    assert stream_lag(7, []).behind == 7
    assert stream_lag(7, [{"name": GROUP, "lag": None}]).behind == 7
    missing = stream_lag(redis.ResponseError("no such key"), redis.ResponseError("no such key"))
    assert (missing.length, missing.lag, missing.group, missing.behind) == (0, None, None, 0)
