"""Workers gone for good, taken out of the fleet index: `dgr ops forget-gone` (and the control plane's cron,
DGR_FORGET_AFTER_S).

`dgr:workers` keeps every worker id that ever advertised, and where each pod has its own id it grows with every
rollout: every fleet read of every Tracker pays an entry per id (docs/placement.md), every ops run a pass. A
worker id is taken out of the index (SREM; none of its keys is touched: its results, accounting and dead letters
stay, readable by naming it) once

* no process holds it: no heartbeat key and no lease key;
* a look found it so at least `gone_for_s` ago, on Redis' clock: the first look that finds it gone writes the
  server's TIME into `dgr:workers:gone` (worker -> ms), a look that finds it back removes it;
* its accounting is in the ledger: a roll-up of its accounts in the same run folds what is left (the counters of
  a worker no process holds do not move), and none is refused as regressed (a roll-up racing this one);
* its dead-letter stream is empty (an operator may still want to read or replay what is there).

A worker that comes back is in the index again within a beat: its heartbeat adds it (consumer/transport/upkeep.py),
and the roll-up folds whatever its counters gained since (docs/accounting.md: its `acct:account:*` hashes are
never deleted)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from schemas.keys import WORKERS_GONE, WORKERS_INDEX, WorkerKeys

from .common import Client, r, redis_time_ms, s, workers
from .rollup import rollup

__all__ = ["Forgot", "forget_gone"]

Status = Literal["up", "held", "noted", "waiting", "dead_letters", "unfolded", "forgotten"]


@dataclass(frozen=True, slots=True)
class Forgot:
    worker_id: str
    status: Status  # up: it beats; held: its lease is held; noted: found gone now; waiting: gone, not long enough
    gone_s: float | None = None  # how long a look first found it gone (Redis' clock)
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "status": self.status, "gone_s": self.gone_s, "detail": self.detail}


def forget_gone(client: Client, gone_for_s: float, *, worker_ids: Iterable[str] | None = None,
                dry_run: bool = False) -> list[Forgot]:
    """One look at every worker of the index (or `worker_ids`): a row each, `forgotten` for those taken out."""
    now = redis_time_ms(client)
    ids = workers(client, worker_ids)
    pipe = client.pipeline(transaction=False)  # every worker's state in one round trip
    for w in ids:
        k = WorkerKeys(w)
        pipe.exists(k.heartbeat)
        pipe.exists(k.lease)
        pipe.hget(WORKERS_GONE, w)
    state = r(pipe.execute()) if ids else []
    out: list[Forgot] = []
    for i, w in enumerate(ids):
        beats, held, seen = int(state[3 * i]), int(state[3 * i + 1]), state[3 * i + 2]
        if beats or held:
            if seen is not None and not dry_run:
                client.hdel(WORKERS_GONE, w)
            out.append(Forgot(w, "up" if beats else "held"))
        elif seen is None:
            if not dry_run:
                client.hsetnx(WORKERS_GONE, w, str(now))
            out.append(Forgot(w, "noted", 0.0))
        elif (gone_s := max(0.0, (now - int(s(seen))) / 1000)) < gone_for_s:
            out.append(Forgot(w, "waiting", gone_s))
        else:
            out.append(_forget(client, w, gone_s, dry_run))
    return out


def _forget(client: Client, w: str, gone_s: float, dry_run: bool) -> Forgot:
    k = WorkerKeys(w)
    letters = int(r(client.xlen(k.dead_letters)))
    if letters:
        return Forgot(w, "dead_letters", gone_s, f"{letters} dead letters (dgr ops dlq list --worker {w})")
    if dry_run:
        return Forgot(w, "forgotten", gone_s, "would be")
    report = rollup(client, worker_ids=[w])
    if report.count("regressed"):
        return Forgot(w, "unfolded", gone_s, "a roll-up refused a fold (another one racing): next look")
    client.srem(WORKERS_INDEX, w)
    client.hdel(WORKERS_GONE, w)
    folded = report.count("folded")
    return Forgot(w, "forgotten", gone_s, f"{folded} accounts folded first" if folded else "")
