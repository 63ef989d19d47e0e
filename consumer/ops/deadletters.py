"""Dead letters: list them, and replay chosen ones into their original stream after a fix.

A dead letter (`dgr:{W}:dlq`, written by the worker's scripts) has the fields `reason`, `detail`,
`stream` (the input stream it came from), `entry_id` (its id there), sometimes `deliveries` and
`consumer`, and the original entry's fields prefixed `f:`.

A replay is one Lua call on the worker's slot that, atomically:
1. re-reads the dead letter and checks its `stream` field is the stream passed in KEYS
   (Python checks that stream is an input stream of the same worker: a dead letter can never make
   us write outside `dgr:{W}:in:*`);
2. SET NX `dgr:{W}:dlq:replayed:<dlq id>` (refuses when already set: a dead letter is replayed at
   most once);
3. XADDs the original `f:` fields to that stream (a new entry: the consumer group delivers it like
   any other, with a fresh delivery count);
4. XADDs an audit record to `dgr:{W}:dlq:audit`: who, at (server time), dlq_id, stream,
   original entry_id, new_id, reason, note.
The dead letter itself stays (it is the evidence); `list` shows what it was replayed as.
A replayed step job keeps its job_id: if it had completed after all, the worker's result record
(SET NX) makes the replay change nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from schemas.keys import WorkerKeys, parse_input_stream
from schemas.limits import DLQ_AUDIT_MAXLEN

from ..lua import script_source
from .common import Client, OpsKeys, load_script, r, s, workers

AUDIT_MAXLEN = DLQ_AUDIT_MAXLEN

REPLAY_LUA = script_source("replay")  # consumer/lua/replay.lua

ReplayStatus = Literal["replayed", "already", "missing", "mismatch", "empty", "invalid"]


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One entry of a worker's dead-letter stream, as `dgr ops dlq` reads it (what was given up on is the
    transport's `DeadLetter`: consumer/transport/protocol.py)."""

    worker_id: str
    id: str  # id in the dead-letter stream
    reason: str
    detail: str
    stream: str  # original input stream
    entry_id: str  # original entry id
    fields: dict[str, str]  # the original entry's fields ('f:' stripped)
    extra: dict[str, str] = field(default_factory=dict)  # deliveries, consumer, ...
    replayed_as: str | None = None

    @property
    def ref(self) -> str:
        """`<worker>/<id>`: what `dgr ops dlq replay` takes."""
        return f"{self.worker_id}/{self.id}"

    def as_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "worker_id": self.worker_id, "id": self.id, "reason": self.reason,
                "detail": self.detail, "stream": self.stream, "entry_id": self.entry_id, "fields": self.fields,
                "extra": self.extra, "replayed_as": self.replayed_as}


@dataclass(frozen=True, slots=True)
class Replay:
    worker_id: str
    dlq_id: str
    status: ReplayStatus
    new_id: str | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "dlq_id": self.dlq_id, "status": self.status, "new_id": self.new_id,
                "detail": self.detail}


def parse_dead_letter(worker_id: str, entry_id: str, raw: dict[str, str],
                      replayed_as: str | None = None) -> DeadLetterEntry:
    fields = {k[2:]: v for k, v in raw.items() if k.startswith("f:")}
    known = ("reason", "detail", "stream", "entry_id")
    extra = {k: v for k, v in raw.items() if not k.startswith("f:") and k not in known}
    return DeadLetterEntry(worker_id, entry_id, raw.get("reason", ""), raw.get("detail", ""), raw.get("stream", ""),
                      raw.get("entry_id", ""), fields, extra, replayed_as)


def _entries(reply: Any) -> list[tuple[str, dict[str, str]]]:
    return [(s(eid), {s(k): s(v) for k, v in (f or {}).items()}) for eid, f in reply]


def list_dead_letters(client: Client, worker_ids: Iterable[str] | None = None, *, count: int = 100,
                      reason: str | None = None, newest_first: bool = True) -> list[DeadLetterEntry]:
    """Up to `count` dead letters per worker (newest first by default), with their replay status."""
    out: list[DeadLetterEntry] = []
    for w in workers(client, worker_ids):
        dlq = WorkerKeys(w).dead_letters
        reply = r(client.xrevrange(dlq, count=count) if newest_first else client.xrange(dlq, count=count))
        entries = [(eid, f) for eid, f in _entries(reply) if reason is None or f.get("reason") == reason]
        if not entries:
            continue
        ok = OpsKeys(w)
        marks = cast(list[Any], r(client.mget([ok.dlq_replayed(eid) for eid, _ in entries])))
        out += [parse_dead_letter(w, eid, f, s(m) if m is not None else None) for (eid, f), m in zip(entries, marks,
                                                                                                     strict=True)]
    return out


def dead_letter_count(client: Client, worker_id: str) -> int:
    return int(r(client.xlen(WorkerKeys(worker_id).dead_letters)))


def parse_ref(ref: str, default_worker: str | None = None) -> tuple[str, str]:
    """`worker/id` or, with a default worker, a bare id."""
    if "/" in ref:
        w, i = ref.rsplit("/", 1)
        return w, i
    if default_worker is None:
        raise ValueError(f"{ref!r}: give <worker>/<id>, or pass --worker")
    return default_worker, ref


def replay(client: Client, worker_id: str, dlq_ids: Iterable[str], *, who: str, note: str = "",
           marker_ttl_s: int = 0) -> list[Replay]:
    """Replay dead letters of one worker into their original streams (each at most once)."""
    script = load_script(client, REPLAY_LUA)
    keys = WorkerKeys(worker_id)
    ok = OpsKeys(worker_id)
    out: list[Replay] = []
    for dlq_id in dlq_ids:
        reply = _entries(r(client.xrange(keys.dead_letters, dlq_id, dlq_id)))
        if not reply:
            out.append(Replay(worker_id, dlq_id, "missing"))
            continue
        stream = reply[0][1].get("stream", "")
        parsed = parse_input_stream(stream)
        if parsed is None or parsed[0] != worker_id:
            out.append(Replay(worker_id, dlq_id, "invalid",
                              detail=f"stream {stream!r} is not an input stream of worker {worker_id!r}"))
            continue
        res = script(keys=[keys.dead_letters, stream, ok.dlq_replayed(dlq_id), ok.dlq_audit],
                     args=[dlq_id, who, note, marker_ttl_s, AUDIT_MAXLEN])
        status = cast(ReplayStatus, s(res[0]))
        arg = s(res[1]) if len(res) > 1 else None
        if status in ("replayed", "already"):
            out.append(Replay(worker_id, dlq_id, status, new_id=arg))
        else:
            out.append(Replay(worker_id, dlq_id, status, detail=arg or ""))
    return out


def audit_log(client: Client, worker_id: str, count: int = 100) -> list[dict[str, str]]:
    reply = _entries(r(client.xrevrange(OpsKeys(worker_id).dlq_audit, count=count)))
    return [{"id": eid, **f} for eid, f in reply]
