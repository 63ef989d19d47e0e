"""Completions written the way the transport tests think of them: one record per answered delivery
(`Completion`), filed through the transport's one primitive (`Transport.complete`, wire version 2), with
whether each was the first to be published (not a row the completion script left out, `Charges.d`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from consumer.sched import Answer, Outcome
from consumer.transport import DeadLetter, Delivery, Filing, FusedCallStats, RedisTransport
from schemas import StepResult, WireError, job_from_fields


@dataclass(frozen=True)
class Completion:
    delivery: Delivery
    result: StepResult
    account_id: str | None
    phase: str = "decode"
    close: Literal["finished", "cancelled"] | None = None


def answer_of(c: Completion) -> Answer:
    try:
        job = job_from_fields(c.delivery.fields) if c.delivery.fields else None
    except WireError:
        job = None
    r = c.result
    acct = r.accounting
    outcome = Outcome(r.job_id, r.session_id, r.status, r.reason, r.position, r.detail, r.token, r.finished,
                      acct.prompt_tokens, acct.engine_seconds, r.batch_size, r.hidden)
    return Answer(ref=c.delivery, job=job, result=outcome, account_id=c.account_id, close=c.close)


def complete_entries(t: RedisTransport, completions: Sequence[Completion], dead: Sequence[DeadLetter] = (),
                     call: FusedCallStats | None = None) -> list[bool]:
    """File the completions in one call; per completion, whether its answer was published by this call."""
    answers = [answer_of(c) for c in completions]
    charges = t.complete(Filing(answers, dead, call=call))
    order: dict[str, list[int]] = {}  # reply stream -> completion indices, in row order (publish.py groups so)
    for i, a in enumerate(answers):
        reply = a.reply or (a.job.reply if a.job is not None else a.result.session_id)
        order.setdefault(reply, []).append(i)
    fresh = [False] * len(answers)
    if not charges:  # the call had been filed already (a re-sent completion)
        return fresh
    for rows, raw in zip(order.values(), charges, strict=True):
        dups = set(json.loads(raw)["d"])
        for row, i in enumerate(rows):
            fresh[i] = row not in dups
    return fresh
