"""`dgr ops drain` / `undrain`: take a worker out of placement and let it empty (rolling upgrades).

Draining is a key the control plane sets in the worker's hash tag (`WorkerKeys.drain`, JSON {at, by}). A
Tracker placing sessions reads it with the worker's advertisement (`producer.WorkerInfo.draining`) and never
places a new session there; the worker reads it with its input lag each heartbeat, advertises `draining` in
its heartbeat (`dgr inspect`), goes on serving the sessions it holds, and with `--exit-when-drained` stops
(exit 0) once it holds none and nothing waits on its input streams. A session opened with a SessionSpec that
names the worker is still served: draining steers placement, it refuses nobody.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from schemas.keys import WorkerKeys

from .common import Client, s

__all__ = ["DrainState", "drain", "drain_state", "undrain"]


@dataclass(frozen=True, slots=True)
class DrainState:
    worker_id: str
    draining: bool
    since: float | None = None
    by: str | None = None
    advertised: bool | None = None  # what the worker's last heartbeat said (None: no heartbeat)
    busy_slots: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"worker": self.worker_id, "draining": self.draining, "since": self.since, "by": self.by,
                "advertised": self.advertised, "busy_slots": self.busy_slots}


def drain(client: Client, worker_id: str, who: str) -> DrainState:
    """Set the worker's drain key (idempotent: the first drain's time and operator are kept)."""
    client.set(WorkerKeys(worker_id).drain, json.dumps({"at": time.time(), "by": who}), nx=True)
    return drain_state(client, worker_id)


def undrain(client: Client, worker_id: str) -> DrainState:
    client.delete(WorkerKeys(worker_id).drain)
    return drain_state(client, worker_id)


def drain_state(client: Client, worker_id: str) -> DrainState:
    k = WorkerKeys(worker_id)
    pipe = client.pipeline(transaction=False)
    pipe.get(k.drain)
    pipe.get(k.heartbeat)
    raw, hb_raw = pipe.execute()
    since = by = None
    if raw is not None:
        try:
            d = json.loads(s(raw))
            since, by = float(d.get("at")), str(d.get("by"))
        except (ValueError, TypeError, AttributeError):
            pass
    advertised = busy = None
    if hb_raw is not None:
        try:
            hb = json.loads(s(hb_raw))
            advertised = bool(hb.get("draining"))
            b = hb.get("busy_slots")
            busy = b if isinstance(b, int) else None
        except (ValueError, AttributeError):
            pass
    return DrainState(worker_id, raw is not None, since, by, advertised, busy)
