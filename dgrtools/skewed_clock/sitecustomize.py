"""Loaded at start-up by a Python process whose PYTHONPATH starts with this folder (`ConsumerProcess(...,
clock_skew_s=S)`): its wall clock (time.time, time.time_ns) reads DGR_CLOCK_SKEW_S seconds off, as on a host whose
clock is wrong; monotonic clocks and Redis' own are untouched. For the tests of a fleet whose hosts disagree on
the time (tests/test_fleet_clock.py)."""

import os
import time

_SKEW = float(os.environ.get("DGR_CLOCK_SKEW_S", "0") or 0)
if _SKEW:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _SKEW
    time.time_ns = lambda: _time_ns() + int(_SKEW * 1e9)
