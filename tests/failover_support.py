"""What the failover tests check, and the one place they read the service's own keys.

Redis replication is asynchronous: a master killed with writes its replica never received loses them
at the failover, acknowledged or not. Whatever was lost, the Producer API must still end every
session with its solo tokens (the black-box part, `check_failover`). What the new master holds of each
session (its result stream, its accounting) may then lack what was lost, but never hold a token twice;
and what its tally says it lost (`owed`, docs/accounting.md) is reported next to what was lost. The
service's keys (wire version 2: result records, the tally and session hashes) are read in ONE function,
`read_service_record`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from consumer.ops.sessions import session_accounting
from producer import SessionHandle
from schemas import SessionSpec, Status, WorkerKeys
from tests.chaos_support import NOT_COUNTERS
from tests.support import session_results

from .chaos_support import report, solo


@dataclass
class SessionRecord:
    """What Redis holds of one session after a run."""

    job_ids: list[str] = field(default_factory=list)  # every answer in its result stream, in stream order
    ok_tokens: dict[int, int] = field(default_factory=dict)  # generated index -> token, from the OK answers
    ok_count: int = 0  # OK answers that carried a token (ok_tokens counts each index once)
    billed: dict[str, float] = field(default_factory=dict)  # its accounting counters
    closed: str | None = None  # how its accounting was closed, None while open
    gaps: int = 0  # answer positions the tally found missing and no re-send filled (docs/accounting.md)
    owed: int = 0  # positions no surviving answer charged: charges lost


def positions(ranges: str) -> int:
    """How many positions a tally's range list ('lo:hi,lo:hi', '-' for none) names."""
    if ranges in ("", "-"):
        return 0
    return sum(int(hi) - int(lo) + 1 for lo, hi in (r.split(":") for r in ranges.split(",")))


def read_service_record(client: redis.Redis, worker: str, specs: Sequence[tuple[SessionSpec, list[int]]]
                        ) -> tuple[dict[str, SessionRecord], dict[str, dict[str, float]]]:
    """THE helper that reads keys issue 21 moves: each session's result stream and accounting hash,
    and each billing account's counters. Returns (records by session id, counters by account)."""
    keys = WorkerKeys(worker)
    records: dict[str, SessionRecord] = {}
    accounts: dict[str, dict[str, float]] = {}
    for spec, prompt in specs:
        rec = SessionRecord()
        for r in session_results(client, worker, spec.session_id):
            rec.job_ids.append(r.job_id)
            if r.status == Status.OK and r.token is not None:
                rec.ok_tokens[r.position - len(prompt)] = r.token
                rec.ok_count += 1
        acct = session_accounting(client, worker, spec.session_id)
        rec.closed = acct.pop("closed", None)
        rec.gaps, rec.owed = positions(acct.get("gaps", "-")), positions(acct.get("owed", "-"))
        rec.billed = {k: float(v) for k, v in acct.items() if k.encode() not in NOT_COUNTERS and k != "t"}
        records[spec.session_id] = rec
        if spec.account_id not in accounts:
            raw = client.hgetall(keys.billing_account(spec.account_id))
            accounts[spec.account_id] = {k.decode(): float(v) for k, v in raw.items()}
    return records, accounts


def check_failover(client: redis.Redis, worker: str, specs: Sequence[tuple[SessionSpec, list[int]]],
                   handles: dict[str, SessionHandle], model: Path, **extra: Any) -> dict[str, Any]:
    """After a failover: every session finished with its solo tokens (Producer API); in Redis no job
    answered twice, no token billed twice or billed without its answer, every answer kept the token the
    producer got, every account the sum of its sessions. Returns what the failover lost (reported with
    DGR_CHAOS_REPORT, like the chaos suite's scenarios)."""
    records, accounts = read_service_record(client, worker, specs)
    lost = {"sessions": len(specs), "finished": 0, "tokens_lost": 0, "prompt_tokens_lost": 0,
            "sessions_with_loss": 0, "unclosed": 0, "owed_positions": 0, "gap_positions": 0, "cached_tokens": 0,
            "replays": sum(h.attempt for h in handles.values()), **extra}
    by_account: dict[str, dict[str, float]] = {}
    for spec, prompt in specs:
        sid, h, rec = spec.session_id, handles[spec.session_id], records[spec.session_id]
        assert h.status == "finished", (sid, h.status, h.reason, h.detail)
        assert h.generated == solo(model, prompt, spec.max_tokens), (sid, h.generated)
        lost["finished"] += 1
        assert len(rec.job_ids) == len(set(rec.job_ids)), f"{sid}: a job answered twice in its result stream"
        assert rec.ok_count == len(rec.ok_tokens), f"{sid}: a token answered twice"
        for i, tok in rec.ok_tokens.items():
            assert 0 <= i < len(h.generated) and h.generated[i] == tok, (sid, i, tok, h.generated)
        generated = int(rec.billed.get("generated_tokens", 0))
        prompt_billed = int(rec.billed.get("prompt_tokens", 0))
        # One script writes an answer and bills it: whatever a failover lost, it lost both or neither.
        assert generated == len(rec.ok_tokens), (sid, rec.billed, len(rec.ok_tokens))
        assert generated <= len(h.generated) and prompt_billed <= len(prompt), (sid, rec.billed)
        cached = int(rec.billed.get("cached_tokens", 0))  # the prefix cache's hits: a part of the prompt tokens
        assert cached <= prompt_billed, (sid, rec.billed)
        lost["cached_tokens"] += cached
        lost["tokens_lost"] += len(h.generated) - generated
        lost["prompt_tokens_lost"] += len(prompt) - prompt_billed
        # `owed` names charges the tally knows it lost: never more than were lost (docs/failover.md)
        assert rec.owed <= len(h.generated) - generated + len(prompt) - prompt_billed, (sid, rec.owed, rec.billed)
        lost["sessions_with_loss"] += int(generated < len(h.generated) or prompt_billed < len(prompt))
        lost["unclosed"] += int(rec.closed is None)
        lost["owed_positions"] += rec.owed  # what the tally itself says it lost (detection, not asserted)
        lost["gap_positions"] += rec.gaps
        tally = by_account.setdefault(spec.account_id, {})
        for k, v in rec.billed.items():
            tally[k] = tally.get(k, 0.0) + v
    for account, tally in by_account.items():
        got = accounts[account]
        for counter, total in tally.items():
            assert abs(got.get(counter, 0.0) - total) <= 1e-6 * max(1.0, total), (account, counter, got, tally)
    report(lost)
    return lost
