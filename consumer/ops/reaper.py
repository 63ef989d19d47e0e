"""Reaper: cancel sessions idle past a TTL through the normal cancellation path.

Which sessions: every session the worker charges and has not closed, i.e. every field of its tally hash
`dgr:{W}:tally` (docs/accounting.md; the completion script writes it with each answer and removes it when
the session closes: finished, cancelled or failed), whose cancel marker is not set (it was not cancelled,
by its Tracker or by this reaper).

Idle since: the tally's `t`, the Redis server's clock at the session's last answer, so idleness is
measured on one clock, never the reaper's. A session whose producer keeps pushing steps is answered, so
never idle. The TTL must exceed the longest time a step may wait in the input stream (queueing under
load), else a session waiting behind a backlog is cancelled.

How: one Lua call per candidate, on the worker's slot, re-checks all of the above against the server's
TIME and only then XADDs `{session_id}` to `dgr:{W}:cancel` (what `Producer.cancel` does) and sets the
session's cancel marker (naming who reaped it and when), as `Producer.cancel` does: the session is
cancelled once, even if the worker no longer holds it, and a replay does not revive it. The worker frees
the slot when it reads the cancellation, answers the session `cancelled`, and closes its accounting.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.keys import WorkerKeys
from schemas.limits import CANCEL_MARKER_TTL_S, CANCEL_MAXLEN

from ..lua import script_source
from .common import Client, load_script, s, workers
from .sessions import open_tallies

REAP_LUA = script_source("reap")  # consumer/lua/reap.lua

ReapStatus = Literal["cancelled", "idle", "active", "reaped", "gone"]


@dataclass(frozen=True, slots=True)
class Reaped:
    worker_id: str
    session_id: str
    status: ReapStatus
    idle_s: float | None  # None: not known

    def as_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "session_id": self.session_id, "status": self.status,
                "idle_s": self.idle_s}


def open_sessions(client: Client, worker_id: str) -> list[str]:
    """Session ids the worker charges and has not closed, whose cancel marker is not set."""
    sids = sorted(open_tallies(client, worker_id))
    if not sids:
        return []
    keys = WorkerKeys(worker_id)
    pipe = client.pipeline(transaction=False)
    for sid in sids:
        pipe.exists(keys.cancel_marker(sid))
    marked: list[Any] = pipe.execute()
    return [sid for sid, m in zip(sids, marked, strict=True) if not int(m)]


def reap(client: Client, ttl_s: float, *, worker_ids: Iterable[str] | None = None, dry_run: bool = False,
         who: str = "reaper") -> list[Reaped]:
    """Cancel (or, dry run, list) the open sessions idle longer than `ttl_s`. Returns one row per open
    session looked at."""
    script = load_script(client, REAP_LUA)
    ttl_ms = max(0, int(ttl_s * 1000))
    out: list[Reaped] = []
    for w in workers(client, worker_ids):
        keys = WorkerKeys(w)
        for sid in open_sessions(client, w):
            res = script(keys=[keys.tally, keys.cancellations, keys.cancel_marker(sid)],
                         args=[sid, ttl_ms, CANCEL_MAXLEN, who, "1" if dry_run else "0", CANCEL_MARKER_TTL_S])
            idle_ms = int(res[1])
            out.append(Reaped(w, sid, s(res[0]), None if idle_ms < 0 else idle_ms / 1000.0))  # type: ignore[arg-type]
    return out
