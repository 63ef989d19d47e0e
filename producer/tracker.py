"""The Tracker's operations, written once for both drivers (as redis-py's command mixins serve its sync and
asyncio clients): each method hands one of the core's plans to the driver's `_call`, which runs it, blocking
(`Producer`: the value) or as a coroutine (`AsyncProducer`: an awaitable of it).

Driving sessions by hand: `open()` pushes the prompt as prefill chunks (the SessionSpec on the first, a token
wanted back only from the last) and the session's record, in one MULTI/EXEC; every answer read by
`read_results()` lets the caller push the next decode step (`push_decode`), or `replay()` after state_lost.
`run_many()` / `generate()` / `drive()` do all of it themselves, for routes of any length.

`execute` / `aexecute` are the one place the typed commands (producer/commands.py) meet redis-py: how each is
sent (on a client or a pipeline, sync or asyncio alike: a pipeline queues synchronously) and how its reply is read
(schemas/replies.py). A single command goes alone (`client.xread(...)`), several as one pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from schemas import SessionSpec
from schemas.direct import Direct, stream_pairs, xread_command
from schemas.replies import as_str, entry_fields, range_reply, read_reply, str_map
from schemas.retry import OutageRider, RetryPolicy

from . import commands as c
from .commands import Plan
from .core import ProducerCore
from .placement import SessionTemplate
from .resume import resume
from .session import SessionHandle
from .settings import ProducerSettings

__all__ = ["TrackerOps", "aexecute", "execute"]

log = logging.getLogger("dgr.producer")


class TrackerOps:
    """`client`: a redis-py client (sync or asyncio, as the driver); `settings`: one frozen ProducerSettings
    (keyword options override its fields). Every call rides through a Redis outage (schemas/retry.py: backoff
    with jitter for at most `outage_max_s`, one log line per outage and per recovery); after one the core
    re-pushes what its sessions have unanswered and reads their streams again from a little earlier."""

    def __init__(self, client: Any, settings: ProducerSettings | None = None, **options: Any) -> None:
        self.client = client
        self.settings = ProducerSettings.of(settings, options)
        self.core = ProducerCore(self.settings)
        self._rider = OutageRider(RetryPolicy(max_s=self.settings.outage_max_s), log, "producer")

    def _call(self, plan: Plan[Any]) -> Any:
        raise NotImplementedError

    @property
    def outages(self) -> int:
        """Redis outages this producer rode through."""
        return self._rider.outages

    @property
    def tracker_id(self) -> str:
        """The id of this Tracker's result stream on every worker (`dgr:{W}:out:<tracker_id>`)."""
        return self.settings.tracker_id

    def discover(self, worker_id: str) -> Any:
        """The worker's advertised keys and info (WorkerInfo), and its heartbeat. LookupError if it never
        advertised; schemas.WireError (reason schema_version) if it speaks another wire version."""
        return self._call(self.core.discover(worker_id))

    def workers(self) -> Any:
        """Every worker in `dgr:workers` that has an advertisement (WorkerInfo), by id."""
        return self._call(self.core.workers())

    def fleet_now(self) -> Any:
        """`workers()` as placement last read them, read again when older than discover_cache_s (one read at a
        time however many ask): what a caller choosing among workers should see, placement's own view."""
        return self._call(self.core.fleet_now())

    def place(self, template: SessionTemplate, prompt: Sequence[int]) -> Any:
        """The SessionSpec the template would be opened with: each hop on the worker placement chooses now
        (docs/placement.md), counted as placed there. LookupError when a hop has no eligible worker."""
        return self._call(self.core.place(template, prompt))

    def fleet(self) -> dict[str, dict[str, Any]]:
        """Placement's counters per worker: sessions placed, passed over for capacity, the last score's inputs."""
        return self.core.fleet.stats()

    def open(self, spec: SessionSpec | SessionTemplate, prompt: Sequence[int], hop: int = 0) -> Any:
        """A SessionTemplate is placed first (`place`). Validate (hop, tokens, context, the worker advertises the
        key and speaks this wire), check backpressure on the prefill stream, push the prompt; the SessionHandle.
        One hop only (a route of several hops: run_many / generate)."""
        return self._call(self.core.open(spec, prompt, hop))

    def push_decode(self, h: SessionHandle, token: int) -> Any:
        """Push the decode step at h.position feeding `token`; its job id."""
        return self._call(self.core.push_decode(h, token))

    def replay(self, h: SessionHandle) -> Any:
        """After state_lost: attempt + 1, re-open with prompt + generated as the prompt (its max_tokens reduced by
        the tokens generated, its prompt_len the prompt's: the replay is exact, docs/invariance.md). Answers of
        the lost attempt are ignored. A session whose cancel marker is set ends `cancelled` instead; SessionFailed
        when max_attempts is spent."""
        return self._call(self.core.replay(h))

    def cancel(self, worker_id: str, session_id: str) -> Any:
        """Set the session's cancel marker (TTL cancel_ttl_s: it wins over a step not yet admitted, an opening not
        read yet, a replay) and add the cancel event, in one transaction. Both ids are checked first."""
        return self._call(self.core.cancel(worker_id, session_id))

    def cancel_route(self, h: SessionHandle) -> Any:
        """Cancel a session on every hop of its route (one transaction per worker)."""
        return self._call(self.core.cancel_route(h))

    def cancelled(self, worker_id: str, session_id: str) -> Any:
        """Whether the session's cancel marker is set (by this or any other process)."""
        return self._call(self.core.cancelled(worker_id, session_id))

    def read_results(self, handles: Sequence[SessionHandle], block_ms: int = 1000) -> Any:
        """Read the handles' result streams (one XREAD per worker, Redis Cluster safe), blocking up to block_ms
        (<= 0: not at all), apply the answers (tokens, position, status) and return the handles' answers of
        their current attempts, by session id. Answers of older attempts and strays are not applied."""
        return self._call(self.core.read_results(handles, block_ms))

    def resume(self, worker_id: str, session_id: str) -> Any:
        """Rebuild a session's handle in any process from its record and its answers in Redis (producer/resume.py),
        re-push what is unanswered; `drive([handle])` continues it. LookupError without a record, or when its
        answers since its last opening are gone."""
        return self._call(_one(resume(self.core, worker_id, [session_id])))

    def resume_many(self, worker_id: str, session_ids: Sequence[str]) -> Any:
        """`resume` for many sessions opened on one worker (hop 0), one scan per result stream; handles by id."""
        return self._call(resume(self.core, worker_id, list(session_ids)))


def _one(plan: Plan[dict[str, SessionHandle]]) -> Plan[SessionHandle]:
    (h,) = (yield from plan).values()
    return h


_SEND: dict[type, Callable[[Any, Any], Any]] = {
    c.XAdd: lambda t, x: t.xadd(x.stream, x.fields) if x.maxlen is None else
    t.xadd(x.stream, x.fields, maxlen=x.maxlen, approximate=True),
    c.Set: lambda t, x: t.set(x.key, x.value, ex=x.ex),
    c.HSet: lambda t, x: t.hset(x.key, mapping=x.mapping),
    c.Expire: lambda t, x: t.expire(x.key, x.seconds),
    c.Delete: lambda t, x: t.delete(x.key),
    c.Get: lambda t, x: t.get(x.key),
    c.PTtl: lambda t, x: t.pttl(x.key),
    # one MGET; on a Cluster (its keys in many slots) redis-py's one per slot
    c.MGet: lambda t, x: t.mget_nonatomic(x.keys) if hasattr(t, "mget_nonatomic") else t.mget(x.keys),
    c.Exists: lambda t, x: t.exists(x.key),
    c.HGet: lambda t, x: t.hget(x.key, x.field),
    c.HGetAll: lambda t, x: t.hgetall(x.key),
    c.SMembers: lambda t, x: t.smembers(x.key),
    c.XLen: lambda t, x: t.xlen(x.stream),
    c.XInfoGroups: lambda t, x: t.xinfo_groups(x.stream),
    c.XRead: lambda t, x: t.xread(dict(x.streams), count=x.limit, block=x.block_ms or None),
    c.XRange: lambda t, x: t.xrange(x.stream, min=x.start, count=x.limit),
}
_READ: dict[type, Callable[[Any], Any]] = {
    c.Exists: bool, c.HGetAll: str_map, c.SMembers: lambda r: sorted(as_str(x) for x in r or ()),
    c.XRead: read_reply, c.XRange: range_reply,
}


def _xread_direct(direct: Direct, x: c.XRead) -> Any:
    """`client.xread(...)` read as `read_reply` reads it, sent on the kept connection: its raw reply (a RESP3 map
    of streams, each entry's fields a flat list) made the client's shape first."""
    (raw,) = direct(xread_command(dict(x.streams), x.limit, block_ms=x.block_ms))
    if isinstance(raw, Exception):
        raise raw
    return read_reply([(name, [(eid, entry_fields(f)) for eid, f in entries]) for name, entries in stream_pairs(raw)])


def _xadds_direct(direct: Direct, ops: Sequence[Any]) -> None:
    """A pipeline of XADDs as `_SEND` writes each (MAXLEN ~ when a bound is set), on the kept connection; the first
    error raised, as a pipeline's execute raises it (each command ran: a re-send after an outage repeats them,
    as it repeats a pipeline's)."""
    cmds = [("XADD", x.stream, *(("MAXLEN", "~", x.maxlen) if x.maxlen is not None else ()), "*",
             *[v for kv in x.fields.items() for v in kv]) for x in ops]
    for reply in direct(*cmds):
        if isinstance(reply, Exception):
            raise reply


def _parse(cmd: c.Command, raw: Any) -> Any:
    parse = _READ.get(type(cmd))
    return raw if parse is None or isinstance(raw, Exception) else parse(raw)


def _pipeline(client: Any, req: c.Read | c.Batch, transaction: bool | None) -> tuple[Any, Any, Any]:
    """(the first command when it goes alone, or None; the pipeline, or None; the commands)."""
    cmds = req.cmds if isinstance(req, c.Read) else req.ops
    if isinstance(req, c.Read) and len(cmds) == 1 and not req.errors:
        return cmds[0], None, cmds
    pipe = client.pipeline(transaction=(isinstance(req, c.Batch) and req.transaction) if transaction is None
                           else transaction)
    for x in cmds:
        _SEND[type(x)](pipe, x)
    return None, pipe, cmds


def _replies(req: c.Read | c.Batch, cmds: Any, raw: list[Any]) -> Any:
    return [_parse(x, r) for x, r in zip(cmds, raw, strict=True)] if isinstance(req, c.Read) else None


def execute(client: Any, req: c.Read | c.Batch, transaction: bool | None = None, direct: Direct | None = None) -> Any:
    """Send a request on a redis-py client: the parsed replies of a Read, None for a Batch. `transaction`:
    MULTI/EXEC or not, whatever the Batch says. `direct`: the client's kept connection (schemas/direct.py), which
    sends what every loop turn sends: a lone XREAD (its read) and a batch of XADDs outside MULTI (its pushes)."""
    if direct is not None and isinstance(req, c.Read) and len(req.cmds) == 1 and not req.errors \
            and type(req.cmds[0]) is c.XRead:
        return [_xread_direct(direct, req.cmds[0])]
    if direct is not None and isinstance(req, c.Batch) and req.ops and all(type(x) is c.XAdd for x in req.ops) \
            and not (req.transaction if transaction is None else transaction):
        _xadds_direct(direct, req.ops)  # a loop turn's pushes (its sessions' next steps)
        return None
    one, pipe, cmds = _pipeline(client, req, transaction)
    if one is not None:
        return [_parse(one, _SEND[type(one)](client, one))]
    return _replies(req, cmds, pipe.execute(raise_on_error=not (isinstance(req, c.Read) and req.errors)))


async def aexecute(client: Any, req: c.Read | c.Batch, transaction: bool | None = None) -> Any:
    """`execute` on a redis.asyncio client."""
    one, pipe, cmds = _pipeline(client, req, transaction)
    if one is not None:
        return [_parse(one, await _SEND[type(one)](client, one))]
    return _replies(req, cmds, await pipe.execute(raise_on_error=not (isinstance(req, c.Read) and req.errors)))
