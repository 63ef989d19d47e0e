"""Reaper: cancel sessions idle past a TTL through the normal cancellation path.

Which sessions: every per-session accounting hash `dgr:{W}:acct:session:<sid>` (the completion
script creates it on the session's first answered step) that has an `account` field (set once the
worker held the session: a step rejected for an unknown session leaves a hash without it), no
`closed` field (the worker sets it when the session finished, was cancelled or failed) and no
`reaped` field (this reaper already cancelled it).

Idle since: the id of the last entry of the session's result stream `dgr:{W}:out:<sid>` — stream
ids are the Redis server's clock in ms, so idleness is measured on one clock, never the reaper's.
Every answered step XADDs there, so a session whose producer keeps pushing steps is never idle. A
session whose result stream is gone (it expires `result ttl` after its last result) counts as idle.
The TTL must exceed the longest time a step may wait in the input stream (queueing under load),
else a session waiting behind a backlog is cancelled.

How: one Lua call per candidate, on the worker's slot, re-checks all of the above against the
server's TIME and only then XADDs `{session_id}` to `dgr:{W}:cancel` (what `Producer.cancel` does)
and marks the hash `reaped` (so the session is cancelled once, even if the worker no longer holds
it), and sets the session's cancel marker, as `Producer.cancel` does (a replay does not revive it).
The worker frees the slot when it reads the cancellation, and answers the session `cancelled`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.keys import WorkerKeys
from schemas.limits import CANCEL_MARKER_TTL_S, CANCEL_MAXLEN

from ..lua import script_source
from .common import Client, OpsKeys, load_script, s, scan_worker, workers

REAP_LUA = script_source("reap")  # consumer/lua/reap.lua

ReapStatus = Literal["cancelled", "idle", "active", "closed", "reaped", "unknown", "gone"]


@dataclass(frozen=True, slots=True)
class Reaped:
    worker_id: str
    session_id: str
    status: ReapStatus
    idle_s: float | None  # None: the result stream is gone

    def as_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "session_id": self.session_id, "status": self.status,
                "idle_s": self.idle_s}


def open_sessions(client: Client, worker_id: str) -> list[str]:
    """Session ids with an accounting hash that names an account and is neither closed nor reaped."""
    ok = OpsKeys(worker_id)
    names = list(scan_worker(client, worker_id, ok.session_pattern, type_="hash"))
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for k in names:
        pipe.hmget(k, ["closed", "reaped", "account"])
    states: list[Any] = pipe.execute()
    return sorted(ok.session_id_of(k) for k, (closed, reaped, account) in zip(names, states, strict=True)
                  if closed is None and reaped is None and account is not None)


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
            res = script(keys=[keys.session_account(sid), keys.results(sid), keys.cancellations,
                               keys.cancel_marker(sid)],
                         args=[sid, ttl_ms, CANCEL_MAXLEN, who, "1" if dry_run else "0", CANCEL_MARKER_TTL_S])
            idle_ms = int(res[1])
            out.append(Reaped(w, sid, s(res[0]), None if idle_ms < 0 else idle_ms / 1000.0))  # type: ignore[arg-type]
    return out
