"""Reading Redis replies: the one parser both sides use for stream reads (XREAD / XREADGROUP, RESP2 or
RESP3 shapes) and entry field maps, so no part of dgr depends on a reply shape anywhere else."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["as_bytes", "as_str", "entry_fields", "entry_id", "flat_pairs", "id_tuple", "range_reply", "read_reply",
           "str_map", "stream_entries"]


def as_str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def as_bytes(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def stream_entries(resp: Any) -> Iterator[tuple[bytes | str, list[tuple[Any, Any]]]]:
    """(stream name, [(entry id, fields), ...]) of an XREAD / XREADGROUP reply: RESP2 (a list of pairs)
    or RESP3 (a dict); an empty reply yields nothing."""
    if not resp:
        return
    if isinstance(resp, dict):
        for name, value in resp.items():
            yield name, (value[0] if value and isinstance(value[0], list) else value)
    else:
        for name, entries in resp:
            yield name, entries


def entry_fields(fields: Mapping[Any, Any] | Sequence[Any] | None) -> dict[bytes, bytes]:
    """An entry's field map as bytes -> bytes (a client with decode_responses=False returns exactly that:
    then this is a copy), or of its flat [name, value, ...] list (a reply read without the client's callback)."""
    if not fields:
        return {}
    if not isinstance(fields, Mapping):
        return flat_pairs(fields)
    if all(type(k) is bytes and type(v) is bytes for k, v in fields.items()):
        return dict(fields)
    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}


def flat_pairs(flat: Sequence[Any] | None) -> dict[bytes, bytes]:
    """A flat [name, value, name, value, ...] list (as a script returns an entry) as a field map."""
    if not flat:
        return {}
    it = iter(flat)
    return {as_bytes(k): as_bytes(v) for k, v in zip(it, it, strict=False)}


def entry_id(x: bytes | str) -> str:
    """A stream entry id as text ("<ms>-<seq>")."""
    return x.decode("ascii") if isinstance(x, bytes) else x


def read_reply(resp: Any) -> list[tuple[str, list[tuple[str, Any]]]]:
    """An XREAD reply as [(stream name, [(entry id, fields), ...]), ...], names and ids as text (the fields
    as the client returned them: `entry_fields` makes them bytes when a reader needs that)."""
    return [(as_str(name), [(entry_id(eid), f) for eid, f in entries]) for name, entries in stream_entries(resp)]


def range_reply(resp: Sequence[Any] | None) -> list[tuple[str, Any]]:
    """An XRANGE reply as [(entry id, fields), ...], ids as text."""
    return [(entry_id(eid), f) for eid, f in resp or ()]


def str_map(resp: Mapping[Any, Any] | None) -> dict[str, str]:
    """A hash (HGETALL) as text -> text."""
    return {as_str(k): as_str(v) for k, v in (resp or {}).items()}


def id_tuple(x: str) -> tuple[int, int]:
    """A stream entry id as (milliseconds, sequence), for ordering ids ("0-0" for anything unreadable)."""
    ms, _, seq = x.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0
