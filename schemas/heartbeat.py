"""How long ago a worker beat, read on Redis' clock: one reading for the Tracker (placement's staleness, worker
loss) and `dgr inspect`.

A worker's heartbeat `ts` is its own wall clock; a Tracker on another host comparing it with its own clock
reads the difference of the two clocks as age: a worker 10 s behind looks dead (never placed on, its sessions
moved off), one ahead looks alive after it died. So the worker also writes the TTL it set (`ttl_s`), and the
reader asks Redis for the key's remaining TTL in the same round trip: `ttl_s - PTTL` is the time since the write
on the Redis server's clock alone, whatever the two hosts' clocks say. A heartbeat without `ttl_s` (a worker
from before) or a reader that cannot ask PTTL falls back to `ts`.

A heartbeat also names the version of the worker's advertisement (`spec`: its `spec` key's value hashed), so
that a Tracker reads an advertisement again only when it changed (producer/validate.py `Advertisements`)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["TTL_MAX_S", "heartbeat_age", "spec_version"]

TTL_MAX_S = 3600.0  # a heartbeat TTL beyond this is not believed: the age falls back to `ts`


def heartbeat_age(hb: Mapping[str, Any], pttl_ms: object, now: float) -> float | None:
    """Seconds since the heartbeat `hb` (its JSON, parsed) was written: by its `ttl_s` and the key's PTTL reply
    when both are usable, else by its `ts` against `now` (the reader's wall clock); None when neither is (a worker
    that writes no finite `ts` is as good as one that does not beat)."""
    ttl = hb.get("ttl_s")
    if isinstance(ttl, int | float) and not isinstance(ttl, bool) and 0 < ttl <= TTL_MAX_S \
            and isinstance(pttl_ms, int) and not isinstance(pttl_ms, bool) and pttl_ms >= 0:
        return max(0.0, float(ttl) - pttl_ms / 1000)
    ts = hb.get("ts")
    if isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts):
        return max(0.0, now - float(ts))
    return None


def spec_version(raw: bytes | str) -> str:
    """The version of an advertisement (the `spec` key's value as stored) that heartbeats name."""
    return hashlib.sha256(raw.encode() if isinstance(raw, str) else raw).hexdigest()[:16]
