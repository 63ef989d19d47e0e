"""Reading sessions' accounting (docs/accounting.md): the open ones from their worker's tally hash, the
closed ones from their session hash; `session_accounting` gives either as one map of counters."""

from __future__ import annotations

from typing import Any

from schemas.accounting import merge, parse_tally
from schemas.keys import WorkerKeys

from .common import Client, s

__all__ = ["open_tallies", "session_accounting"]


def session_accounting(client: Client, worker_id: str, session_id: str) -> dict[str, str]:
    """prompt_tokens, generated_tokens, recomputed_tokens, steps, engine_seconds (and account, closed once
    closed; att, pub, hw): the session hash plus the open tally. Empty when the worker never charged it."""
    keys = WorkerKeys(worker_id)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(keys.session_account(session_id))
    pipe.hget(keys.tally, session_id)
    h, t = pipe.execute()
    return merge(h or {}, parse_tally(t))


def open_tallies(client: Client, worker_id: str) -> dict[str, dict[str, str]]:
    """Every session the worker charges and has not closed, with its tally (HSCAN: bounded work per call)."""
    out: dict[str, dict[str, str]] = {}
    raw: Any
    for sid, raw in client.hscan_iter(WorkerKeys(worker_id).tally, count=1000):
        t = parse_tally(raw)
        if t is not None:
            out[s(sid)] = t
    return out
