"""The one place the Tracker's typed commands (producer/commands.py) meet redis-py: how each is sent (a
client or a pipeline, sync or asyncio alike: a pipeline queues synchronously) and how its reply is read
(schemas/replies.py). A single command goes alone (`client.xread(...)`), several as one pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.replies import as_str, range_reply, read_reply, str_map

from .commands import (
    Batch,
    Command,
    Delete,
    Exists,
    Expire,
    Get,
    HGetAll,
    HSet,
    Read,
    Set,
    SMembers,
    XAdd,
    XInfoGroups,
    XLen,
    XRange,
    XRead,
)

__all__ = ["aexecute", "execute"]


def _xadd(t: Any, c: XAdd) -> Any:
    if c.maxlen is None:
        return t.xadd(c.stream, c.fields)
    return t.xadd(c.stream, c.fields, maxlen=c.maxlen, approximate=True)


_SEND: dict[type, Callable[[Any, Any], Any]] = {
    XAdd: _xadd,
    Set: lambda t, c: t.set(c.key, c.value, ex=c.ex),
    HSet: lambda t, c: t.hset(c.key, mapping=c.mapping),
    Expire: lambda t, c: t.expire(c.key, c.seconds),
    Delete: lambda t, c: t.delete(c.key),
    Get: lambda t, c: t.get(c.key),
    Exists: lambda t, c: t.exists(c.key),
    HGetAll: lambda t, c: t.hgetall(c.key),
    SMembers: lambda t, c: t.smembers(c.key),
    XLen: lambda t, c: t.xlen(c.stream),
    XInfoGroups: lambda t, c: t.xinfo_groups(c.stream),
    XRead: lambda t, c: t.xread(dict(c.streams), count=c.limit, block=c.block_ms if c.block_ms else None),
    XRange: lambda t, c: t.xrange(c.stream, min=c.start, count=c.limit),
}
_READ: dict[type, Callable[[Any], Any]] = {
    Exists: bool,
    HGetAll: str_map,
    SMembers: lambda r: sorted(as_str(x) for x in r or ()),
    XRead: read_reply,
    XRange: range_reply,
}


def _parse(cmd: Command, raw: Any) -> Any:
    if isinstance(raw, Exception):
        return raw
    parse = _READ.get(type(cmd))
    return raw if parse is None else parse(raw)


def _pipeline(client: Any, req: Read | Batch, transaction: bool | None) -> tuple[Any, Any]:
    cmds = req.cmds if isinstance(req, Read) else req.ops
    if transaction is None:
        transaction = isinstance(req, Batch) and req.transaction
    pipe = client.pipeline(transaction=transaction)
    for c in cmds:
        _SEND[type(c)](pipe, c)
    return pipe, cmds


def _alone(req: Read | Batch) -> Command | None:
    """The one command a request sends alone (no pipeline), if it is one."""
    if isinstance(req, Read) and len(req.cmds) == 1 and not req.errors:
        return req.cmds[0]
    return None


def _raises(req: Read | Batch) -> bool:
    return not (isinstance(req, Read) and req.errors)


def _replies(req: Read | Batch, cmds: Any, raw: list[Any]) -> Any:
    return [_parse(c, r) for c, r in zip(cmds, raw, strict=True)] if isinstance(req, Read) else None


def execute(client: Any, req: Read | Batch, transaction: bool | None = None) -> Any:
    """Send a request on a redis-py client; the parsed replies (a Read), None (a Batch). `transaction`: MULTI/EXEC
    or not, whatever the Batch says."""
    one = _alone(req)
    if one is not None:
        return [_parse(one, _SEND[type(one)](client, one))]
    pipe, cmds = _pipeline(client, req, transaction)
    return _replies(req, cmds, pipe.execute(raise_on_error=_raises(req)))


async def aexecute(client: Any, req: Read | Batch, transaction: bool | None = None) -> Any:
    """`execute` on a redis.asyncio client."""
    one = _alone(req)
    if one is not None:
        return [_parse(one, await _SEND[type(one)](client, one))]
    pipe, cmds = _pipeline(client, req, transaction)
    return _replies(req, cmds, await pipe.execute(raise_on_error=_raises(req)))
