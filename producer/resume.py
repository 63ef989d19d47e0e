"""Rebuilding sessions in another process (a Tracker restarted, or another one taking over): `resume`.

Every (re)opening writes the session's record on hop 0's worker (`dgr:{W}:sess:<sid>`: spec, prompt, attempt,
the tokens it re-feeds, its reply stream and where this Tracker's reading of it stood). A handle is rebuilt
from its record, then every answer of its current attempt found on its hops' result streams is fed through
the same state machine as a live session, with the pushes the original Tracker made rebuilt (not sent).
Answers of several hops arrive on several streams: one waits until the push it answers was rebuilt (a relay,
the next decode step). Then what is unanswered is pushed again (idempotent). Many sessions of one reply stream
cost ONE scan of it (`resume_many`). A session whose answers since its last opening were trimmed from its
stream (MAXLEN: ~10,000 completion calls) or expired cannot be rebuilt (LookupError).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from schemas import SessionSpec, WireError, WorkerKeys
from schemas.replies import id_tuple
from schemas.wire import decode_record

from .commands import Batch, Delete, Get, HGetAll, Plan, Read, XRange
from .route import relay
from .session import SessionHandle, apply
from .settings import READ_COUNT
from .validate import check_id

if TYPE_CHECKING:
    from .core import ProducerCore

__all__ = ["resume"]

Row = tuple[str, Any, Any, int]  # (entry id, record, charges, row index)


def resume(core: ProducerCore, worker_id: str, session_ids: Sequence[str]) -> Plan[dict[str, SessionHandle]]:
    keys = WorkerKeys(check_id(worker_id, "worker_id"))
    records = yield Read(tuple(HGetAll(keys.session_record(check_id(s, "session_id"))) for s in session_ids))
    sink = Batch()  # the original Tracker's pushes, rebuilt: never sent
    handles: dict[str, SessionHandle] = {}
    starts: dict[str, int] = {}  # stream -> the millisecond its scan starts at
    for sid, rec in zip(session_ids, records, strict=True):
        h = handles[sid] = _from_record(core, worker_id, sid, rec, sink)
        read_from = json.loads(rec.get("from") or "{}")
        for w, stream in core.streams_of(h):
            ms = max(0, id_tuple(str(read_from.get(w, "0-0")))[0] - core.settings.rewind_ms)
            starts[stream] = min(starts.get(stream, ms), ms)
    rows: dict[tuple[str, str], deque[Row]] = {}
    ends: dict[str, str] = {}
    for stream, ms in starts.items():
        start = f"{ms}-0" if ms else "-"
        while True:
            (page,) = yield Read((XRange(stream, start, READ_COUNT),))
            for eid, fields in page:
                try:
                    rec, chg = decode_record(fields)
                except WireError:
                    continue
                skip = set(chg.d)
                for i, sid in enumerate(rec.session_id):
                    if sid in handles and i not in skip:
                        rows.setdefault((stream, sid), deque()).append((eid, rec, chg, i))
            if page:
                ends[stream] = page[-1][0]
            if len(page) < READ_COUNT:
                break
            start = "(" + page[-1][0]
    for sid, h in handles.items():
        _feed(core, h, [rows.get((stream, sid), deque()) for _, stream in sorted(core.streams_of(h))], sink)
    yield from _finish(core, list(handles.values()))
    for stream, end in ends.items():
        core.cursors.setdefault(stream, end)  # a stream this Tracker already reads stays where it is
    for h in handles.values():
        core.by_hand[h.session_id] = h
    return handles


def _from_record(core: ProducerCore, worker_id: str, sid: str, rec: dict[str, str], sink: Batch) -> SessionHandle:
    if "spec" not in rec:
        raise LookupError(f"no record of session {sid!r} on worker {worker_id!r}")
    h = SessionHandle(spec=SessionSpec.model_validate_json(rec["spec"]), prompt=tuple(_ints(rec["prompt"])),
                      worker_id=worker_id, reply=rec.get("reply") or None, hop=int(rec.get("hop", "0")),
                      attempt=int(rec.get("attempt", "0")), generated=_ints(rec.get("gen")))
    h.credit.n = max(1, int(rec.get("decode_n", "1")))  # what the original Tracker used
    # the opening of its current attempt, as the original pushed it (with its first continuation, or not)
    core.queue_prefill(sink, h, ramp=rec.get("ramp") == "1", regenerate=rec.get("regen") == "1")
    return h


def _ints(raw: str | None) -> list[int]:
    return [int(t) for t in raw.split(",")] if raw else []


def _feed(core: ProducerCore, h: SessionHandle, queues: list[deque[Row]], sink: Batch) -> None:
    """Apply the session's answers of its current attempt, each stream in order; an answer to a job not pushed
    yet waits for the answer (on another hop's stream) that makes it pushed."""
    opening = next(iter(h.sent))
    done: set[str] = set()
    first: str | None = None
    progress = True
    while progress and not h.finished and h.status != "state_lost":
        progress = False
        for q in queues:
            while q and not h.finished and h.status != "state_lost":
                eid, rec, chg, i = q[0]
                jid = rec.job[i]
                if rec.attempt[i] != h.attempt or jid in done:
                    q.popleft()
                    continue
                s = h.sent.get(jid)
                if s is None:
                    break
                q.popleft()
                progress = True
                first = first or jid
                x = rec.extra.get(str(i)) if rec.extra else None
                if not apply(h, s, rec.offset[i], rec.status[i], rec.position[i], rec.token[i], rec.finished[i], x,
                             rec.engine_seconds[i], chg.p[i], chg.g[i], chg.k[i] if chg.k else 0):
                    continue
                h.last_result_id, h.last_row = eid, (rec, chg, i)
                if jid not in h.sent:
                    done.add(jid)
                if h.relays:
                    relay(core, sink, h, {}, assume_sent=True)
                if not h.finished and h.status != "state_lost":
                    core.advance(sink, h, True)
    if first is not None and first != opening:
        raise LookupError(f"the result stream of session {h.session_id!r} no longer holds its opening's answers "
                          "(trimmed or expired)")


def _finish(core: ProducerCore, handles: list[SessionHandle]) -> Plan[None]:
    """Push again what the rebuilt handles have unanswered: jobs whose input rows are known only by the output
    blob they came from get them again when it is still there (else the job was pushed with them: the original
    Tracker deletes an output blob only in the pipeline that relays it); ended routes release their hops."""
    srcs = [s.src for h in handles for s in h.sent.values() if s.raw is None and s.src is not None]
    got: dict[str, bytes | None] = {}
    if srcs:
        got = dict(zip(srcs, (yield Read(tuple(Get(k) for k in srcs))), strict=True))
    batch = Batch()
    for h in handles:
        for s in h.sent.values():
            if s.raw is None and s.src is not None and got.get(s.src) is not None:
                s.raw = got[s.src]  # never relayed: relay it now
                batch.add(Delete(s.src))
        if h.finished:
            h.released = False
            core.queue_release(batch, h)
        else:
            core.queue_unanswered(batch, h)
    if batch:
        yield batch
