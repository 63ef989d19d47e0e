"""Reading Redis replies: the one parser both sides use for stream reads (XREAD / XREADGROUP, RESP2 or
RESP3 shapes) and entry field maps, so no part of dgr depends on a reply shape anywhere else."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["as_bytes", "as_str", "entry_fields", "flat_pairs", "stream_entries"]


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


def entry_fields(fields: Mapping[Any, Any] | None) -> dict[bytes, bytes]:
    """An entry's field map as bytes -> bytes (a client with decode_responses=False returns exactly that:
    then this is a copy)."""
    if not fields:
        return {}
    if all(type(k) is bytes and type(v) is bytes for k, v in fields.items()):
        return dict(fields)
    return {as_bytes(k): as_bytes(v) for k, v in fields.items()}


def flat_pairs(flat: Sequence[Any] | None) -> dict[bytes, bytes]:
    """A flat [name, value, name, value, ...] list (as a script returns an entry) as a field map."""
    if not flat:
        return {}
    it = iter(flat)
    return {as_bytes(k): as_bytes(v) for k, v in zip(it, it, strict=False)}
