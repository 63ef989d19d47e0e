"""Accounting roll-up: fold every worker's per-account counters into one ledger per account, once.

Source: `dgr:{W}:acct:account:<aid>` (the completion script HINCRBYs it: prompt_tokens,
generated_tokens, steps, engine_seconds) for every aid in `dgr:{W}:acct:accounts`, for every W in
`dgr:workers`. Target: `dgr:{ledger}:account:<aid>` (see `common.ledger_key`), a hash holding

* the totals (`prompt_tokens`, ...), moved by the difference of each fold, and
* the watermark: for every worker, the snapshot of its counters last folded, as fields
  `w:<worker>:<counter>`, plus `folds` and `folded_at`.

One Lua call per (worker, account) compares the snapshot just read with the watermark, adds the
difference to the totals and moves the watermark, atomically, on the ledger key alone. So:

* running the roll-up again changes nothing (the difference is zero);
* a crash anywhere (between accounts, between the read and the fold) loses nothing and counts
  nothing twice: a (worker, account) pair is either folded up to a snapshot or not at all, and the
  next run folds whatever the counters gained since;
* a stale snapshot (two roll-ups racing; the slower one read earlier) is smaller than the
  watermark: it is refused (`regressed`) and changes nothing. The source counters only ever grow;
  never delete a worker's `acct:account:*` hashes (after a final roll-up the ledger keeps the
  worker's share in its watermark fields forever).

Each call touches one slot: the read goes to the worker's slot, the fold to the `{ledger}` slot, so
it runs the same on a Redis Cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from schemas.keys import WorkerKeys

from ..lua import script_source
from .common import LEDGER_INDEX, Client, ledger_key, load_script, r, s, sdict, workers

log = logging.getLogger("dgr.ops.rollup")

INT_COUNTERS = ("prompt_tokens", "generated_tokens", "recomputed_tokens", "cached_tokens", "steps")
FLOAT_COUNTERS = ("engine_seconds",)
META_FIELDS = ("folds", "folded_at")

FOLD_LUA = script_source("fold")  # consumer/lua/fold.lua

FoldStatus = Literal["folded", "unchanged", "regressed"]


@dataclass(frozen=True, slots=True)
class Fold:
    worker_id: str
    account_id: str
    status: FoldStatus
    delta: dict[str, float] = field(default_factory=dict)
    detail: str = ""


@dataclass
class RollupReport:
    folds: list[Fold] = field(default_factory=list)

    def count(self, status: FoldStatus) -> int:
        return sum(1 for f in self.folds if f.status == status)

    @property
    def delta(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in self.folds:
            for k, v in f.delta.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"folded": self.count("folded"), "unchanged": self.count("unchanged"),
                "regressed": self.count("regressed"), "delta": self.delta,
                "folds": [{"worker_id": f.worker_id, "account_id": f.account_id, "status": f.status,
                           "delta": f.delta, "detail": f.detail} for f in self.folds]}


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    account_id: str
    totals: dict[str, float]
    by_worker: dict[str, dict[str, float]]
    folds: int
    folded_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"account_id": self.account_id, "totals": self.totals, "by_worker": self.by_worker,
                "folds": self.folds, "folded_at": self.folded_at}


def _num(v: str) -> float | None:
    try:
        x = float(v)
    except ValueError:
        return None
    return x if x == x and abs(x) != float("inf") else None


def _is_int(v: str) -> bool:
    try:
        int(v)
    except ValueError:
        return False
    return True


def fold_args(account_id: str, worker_id: str, snapshot: dict[str, str]) -> list[str]:
    triples: list[str] = []
    for name in sorted(snapshot):
        v = snapshot[name]
        if ":" in name or _num(v) is None:  # only plain numeric counters
            continue
        kind = "i" if name in INT_COUNTERS and _is_int(v) else "f"
        triples += [name, kind, v]
    return [account_id, worker_id, str(len(triples) // 3), *triples]


def rollup(client: Client, *, worker_ids: Iterable[str] | None = None, account_ids: Iterable[str] | None = None,
           on_fold: Callable[[Fold], None] | None = None) -> RollupReport:
    """Fold every (worker, account) pair once. `on_fold` runs after each committed fold (progress,
    or a test's injected crash)."""
    script = load_script(client, FOLD_LUA)
    only_accounts = set(account_ids) if account_ids is not None else None
    report = RollupReport()
    for w in workers(client, worker_ids):
        keys = WorkerKeys(w)
        aids = sorted(s(a) for a in cast(set[Any], r(client.smembers(keys.accounts_index))))
        for aid in aids:
            if only_accounts is not None and aid not in only_accounts:
                continue
            snapshot = sdict(cast(dict[Any, Any], r(client.hgetall(keys.billing_account(aid)))))
            if not snapshot:
                continue
            res = script(keys=[ledger_key(aid), LEDGER_INDEX], args=fold_args(aid, w, snapshot))
            fold = _fold_of(w, aid, res)
            if fold.status == "regressed":
                log.warning("stale or reset counters, not folded",
                            extra={"worker": w, "account": aid, "detail": fold.detail})
            report.folds.append(fold)
            if on_fold is not None:
                on_fold(fold)
    return report


def _fold_of(worker_id: str, account_id: str, res: Any) -> Fold:
    status = int(res[0])
    if status == 0:
        return Fold(worker_id, account_id, "unchanged")
    if status < 0:
        f, mark, cur = (s(x) for x in res[1:4])
        return Fold(worker_id, account_id, "regressed", detail=f"{f}: watermark {mark} > snapshot {cur}")
    items = [s(x) for x in res[1:]]
    delta = {items[i]: float(items[i + 1]) for i in range(0, len(items), 2)}
    return Fold(worker_id, account_id, "folded", delta)


def ledger_accounts(client: Client) -> list[str]:
    return sorted(s(a) for a in cast(set[Any], r(client.smembers(LEDGER_INDEX))))


def read_ledger(client: Client, account_id: str) -> LedgerEntry:
    raw = sdict(cast(dict[Any, Any], r(client.hgetall(ledger_key(account_id)))))
    totals: dict[str, float] = {}
    by_worker: dict[str, dict[str, float]] = {}
    for k, v in raw.items():
        x = _num(v)
        if x is None:
            continue
        if k.startswith("w:"):
            w, counter = k[2:].rsplit(":", 1)
            by_worker.setdefault(w, {})[counter] = x
        elif k not in META_FIELDS:
            totals[k] = x
    return LedgerEntry(account_id, totals, by_worker, int(raw.get("folds", "0")),
                       float(raw.get("folded_at", "0")))
