"""Helpers the ops tests share (a registered worker, step jobs, completions through the real
completion script), and tests of the small pieces of consumer/ops/common.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from consumer.ops.common import LEDGER_INDEX, OpsKeys, ledger_key, s, sdict, stream_id_ms, workers
from consumer.ops.deadletters import parse_ref
from consumer.ops.jobs import _redacted
from consumer.transport import Closure, DeadLetter, Delivery, Filing, RedisTransport
from schemas import (
    Accounting,
    CompatibilityKey,
    Phase,
    Reason,
    RouteHop,
    SessionSpec,
    Status,
    StepJob,
    StepResult,
    WorkerKeys,
    job_from_fields,
    job_to_fields,
)
from schemas.keys import WORKERS_INDEX
from tests.support import compat_key
from tests.transport_support import Completion, complete_entries

# ------------------------------------------------------------------------------------------ helpers


def make_key(phase: Phase = "decode") -> CompatibilityKey:
    return compat_key(phase, sha="cd" * 32)


def register(client: redis.Redis, worker: str, *, busy_slots: int | None = None) -> RedisTransport:
    t = RedisTransport(client, worker, consumer_name=f"{worker}-c")
    info: dict[str, object] = {"slots": 4, "max_batch": 4}
    t.register([make_key("prefill"), make_key("decode")], info)
    t.heartbeat({**info, **({"busy_slots": busy_slots} if busy_slots is not None else {})})
    return t


PROMPT = 3  # the opening's tokens


def step_job(session: str, pos: int, account: str = "acct-1", worker: str = "w1") -> StepJob:
    """Step `pos` of a session: 0 is its opening (a prompt of PROMPT tokens), n >= 1 its n-th decode step."""
    phase: Phase = "prefill" if pos == 0 else "decode"
    spec = None
    if pos == 0:
        spec = SessionSpec(session_id=session, account_id=account,
                           route=(RouteHop(worker_id=worker, key=make_key("prefill")),), max_tokens=8)
    return StepJob(job_id=f"{session}-{pos}", session_id=session, phase=phase, compat=make_key(phase).digest,
                   start_position=0 if pos == 0 else PROMPT + pos - 1, tokens=(5,) * (PROMPT if pos == 0 else 1),
                   created_at=time.time(), session=spec)


def push(client: redis.Redis, worker: str, jobs: Sequence[StepJob]) -> None:
    keys = WorkerKeys(worker)
    for j in jobs:
        client.xadd(keys.input_stream(make_key(j.phase).digest, j.phase), job_to_fields(j))  # type: ignore[arg-type]


def read_all(t: RedisTransport, n: int = 100) -> list[Delivery]:
    return t.read_streams({s: n for s in t.streams}, block_ms=0, gather_ms=0)


def serve(t: RedisTransport, plan: dict[str, tuple[str, int]], *, secs: float = 0.25) -> None:
    """Answer one step for each session in `plan` ({session: (account, step)}) through the real completion
    script: push, read, complete (an opening charges its PROMPT prompt tokens), 1 generated, `secs`."""
    push(t.client, t.worker_id, [step_job(sid, pos, acct, t.worker_id) for sid, (acct, pos) in plan.items()])
    ds = read_all(t)
    comps = []
    for d in ds:
        job = job_from_fields(d.fields)
        acct = plan[job.session_id][0]
        res = StepResult(job_id=job.job_id, session_id=job.session_id, status=Status.OK,
                         position=job.end_position, token=7,
                         accounting=Accounting(prompt_tokens=len(job.tokens) if job.phase == "prefill" else 0,
                                               generated_tokens=1, engine_seconds=secs),
                         worker_id=t.worker_id, batch_size=len(ds))
        comps.append(Completion(d, res, acct, d.phase))
    assert all(complete_entries(t, comps))


def close(t: RedisTransport, session: str, kind: str = "finished", account: str = "acct-1") -> None:
    """Close a session's accounting as the worker does (its tally folded into its session hash)."""
    t.complete(Filing(closures=[Closure(session, kind, account)]))  # type: ignore[list-item]


def dead_letter(t: RedisTransport, fields: dict[str, str], phase: Phase = "decode",
                reason: Reason = Reason.INCOMPATIBLE, detail: str = "bad compat") -> str:
    """Push a raw entry, read it, dead-letter it through the completion script; returns its dlq id."""
    stream = t.keys.input_stream(make_key(phase).digest, phase)
    t.client.xadd(stream, fields)  # type: ignore[arg-type]
    ds = [d for d in read_all(t) if d.stream == stream]
    assert len(ds) == 1
    complete_entries(t, [], [DeadLetter(ds[0], reason, detail)])
    newest: list[Any] = t.client.xrevrange(t.keys.dead_letters, count=1)  # type: ignore[assignment]
    ((dlq_id, _),) = newest
    return s(dlq_id)


# ------------------------------------------------------------------------------------------ tests


def test_ops_key_names_share_the_worker_tag() -> None:
    ok = OpsKeys("w-7")
    base = WorkerKeys("w-7").base
    assert ok.dlq_audit == f"{base}:dlq:audit" == "dgr:{w-7}:dlq:audit"
    assert ok.dlq_replayed("1-0") == "dgr:{w-7}:dlq:replayed:1-0"
    assert ok.session_id_of(WorkerKeys("w-7").session_account("s:1")) == "s:1"
    assert ledger_key("a") == "dgr:{ledger}:account:a" and LEDGER_INDEX == "dgr:{ledger}:accounts"


def test_small_helpers() -> None:
    assert parse_ref("w1/1-0") == ("w1", "1-0")
    assert parse_ref("5-1", "w2") == ("w2", "5-1")
    with pytest.raises(ValueError):
        parse_ref("5-1")
    assert _redacted("redis://u:secret@h:7/0") == "redis://u:***@h:7/0"
    assert _redacted("redis://h/0") == "redis://h/0"
    assert stream_id_ms("1700000000123-4") == 1700000000123
    assert sdict({b"a": b"1"}) == {"a": "1"}


def test_workers_come_from_the_index(redis_client: redis.Redis) -> None:
    redis_client.sadd(WORKERS_INDEX, "b", "a")
    assert workers(redis_client) == ["a", "b"]
    assert workers(redis_client, ["x", "x", "y"]) == ["x", "y"]
