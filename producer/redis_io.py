"""The one place the Tracker's typed commands (producer/commands.py) meet redis-py: how each is sent (on a client
or a pipeline, sync or asyncio alike: a pipeline queues synchronously) and how its reply is read
(schemas/replies.py). A single command goes alone (`client.xread(...)`), several as one pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.replies import as_str, range_reply, read_reply, str_map

from . import commands as c

__all__ = ["aexecute", "execute"]

_SEND: dict[type, Callable[[Any, Any], Any]] = {
    c.XAdd: lambda t, x: t.xadd(x.stream, x.fields) if x.maxlen is None else
    t.xadd(x.stream, x.fields, maxlen=x.maxlen, approximate=True),
    c.Set: lambda t, x: t.set(x.key, x.value, ex=x.ex),
    c.HSet: lambda t, x: t.hset(x.key, mapping=x.mapping),
    c.Expire: lambda t, x: t.expire(x.key, x.seconds),
    c.Delete: lambda t, x: t.delete(x.key),
    c.Get: lambda t, x: t.get(x.key),
    c.Exists: lambda t, x: t.exists(x.key),
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


def execute(client: Any, req: c.Read | c.Batch, transaction: bool | None = None) -> Any:
    """Send a request on a redis-py client: the parsed replies of a Read, None for a Batch. `transaction`:
    MULTI/EXEC or not, whatever the Batch says."""
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
