"""The Redis commands the Tracker core asks for, as typed values (no client, no reply shape).

A *plan* (a generator in producer/core.py) yields a request and receives its reply: a `Read` (commands
sent as one pipeline; its reply is the list of their replies, parsed by producer/tracker.py), a `Batch`
(writes, sent as one pipeline or MULTI/EXEC; reply None) or a `Sleep`. Replies a plan sees: `Get` bytes or
None, `MGet` a list of those, `PTtl` the key's remaining TTL in ms (-2: no key, -1: none set), `Exists` bool,
`HGetAll` dict[str, str], `SMembers` list[str], `XRead` [(stream, [(id, fields)])], `XRange` [(id, fields)],
`XLen` / `XInfoGroups` the value or the error (`Read(errors=True)`).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

__all__ = ["Batch", "Command", "Delete", "Exists", "Expire", "Get", "HGet", "HGetAll", "HSet", "MGet", "PTtl", "Plan",
           "Read", "Request", "SMembers", "Set", "Sleep", "XAdd", "XInfoGroups", "XLen", "XRange", "XRead"]

T = TypeVar("T")


class XAdd(NamedTuple):
    stream: str
    fields: Mapping[str, str]
    maxlen: int | None = None  # approximate (MAXLEN ~)


class Set(NamedTuple):
    key: str
    value: bytes | str
    ex: int | None = None


class HSet(NamedTuple):
    key: str
    mapping: Mapping[str, str]


class Expire(NamedTuple):
    key: str
    seconds: int


class Delete(NamedTuple):
    key: str


class Get(NamedTuple):
    key: str


class PTtl(NamedTuple):
    key: str


class MGet(NamedTuple):
    """GET of many keys in one command (per slot on a Cluster): alone in its Read."""

    keys: tuple[str, ...]


class Exists(NamedTuple):
    key: str


class HGet(NamedTuple):
    key: str
    field: str


class HGetAll(NamedTuple):
    key: str


class SMembers(NamedTuple):
    key: str


class XLen(NamedTuple):
    stream: str


class XInfoGroups(NamedTuple):
    stream: str


class XRange(NamedTuple):
    stream: str
    start: str
    limit: int  # start: "-", an id, "(" + id


class XRead(NamedTuple):
    streams: tuple[tuple[str, str], ...]  # (stream, read after this id)
    limit: int  # entries per stream
    block_ms: int | None = None  # None: do not block


Command = (XAdd | Set | HSet | Expire | Delete | Get | MGet | PTtl | Exists | HGet | HGetAll | SMembers | XLen
           | XInfoGroups | XRead | XRange)


class Read(NamedTuple):
    """Commands sent together (one pipeline; a single one alone). `errors`: a failed command's reply is its
    exception, not raised. Hashable: the asyncio driver asks Redis once for equal reads in flight together."""

    cmds: tuple[Command, ...]
    errors: bool = False


class Sleep(NamedTuple):
    seconds: float


@dataclass(eq=False, slots=True, kw_only=True)
class Batch:
    """Writes queued by the core, sent as one pipeline (`transaction`: MULTI/EXEC, every key in the hash tag
    of worker `tag`), and again as a whole after an outage: each is idempotent (pushes carry job ids a worker
    answers once; the record, markers and blobs are plain overwrites)."""

    transaction: bool = False
    tag: str | None = None
    ops: list[Command] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.ops)

    def add(self, cmd: Command) -> None:
        self.ops.append(cmd)


Request = Read | Batch | Sleep
Plan = Generator[Request, Any, T]
