"""A session's accounting as the completion script keeps it (docs/accounting.md): while the session is
open, a field of its worker's tally hash (`WorkerKeys.tally`); once closed, its session hash
(`WorkerKeys.session_account`), into which the tally was folded. Pure: reading Redis is the caller's."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Final

__all__ = ["COUNTERS", "TALLY_FIELDS", "TALLY_LUA_FORMAT", "merge", "pack_tally", "parse_tally"]

# The tally value's fields, in order. consumer/lua/complete.lua writes them with Redis' `struct` library
# as `TALLY_LUA_FORMAT`: nine little-endian numbers (att, pub, hw, prompt, gen, recomp, steps as int64,
# es as a double, t as int64: the server's clock, unix seconds, at the session's last answer), then
# three strings each after its uint16 length: gaps (result positions not published) and owed (positions
# not charged), '-' or 'lo:hi,...', and the account. Binary, not JSON: the completion script decodes and
# re-encodes every session of every call, and this halves its cost per token (docs/benchmarks.md).
TALLY_FIELDS: Final = ("att", "pub", "hw", "prompt_tokens", "generated_tokens", "recomputed_tokens", "steps",
                       "engine_seconds", "t", "gaps", "account", "owed")
TALLY_LUA_FORMAT: Final = "<llllllldlHc0Hc0Hc0"
_NUMBERS: Final = struct.Struct("<qqqqqqqdq")
_LEN: Final = struct.Struct("<H")
# What the tally adds to the session hash when folded; the other fields are positions, set, not added.
COUNTERS: Final = ("prompt_tokens", "generated_tokens", "recomputed_tokens", "steps", "engine_seconds")


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def parse_tally(raw: bytes | str | None) -> dict[str, str] | None:
    """A tally field's value as named fields, each as text (None: no field, or not a tally value)."""
    if raw is None:
        return None
    data = raw.encode("latin-1") if isinstance(raw, str) else raw
    try:
        nums = _NUMBERS.unpack_from(data)
        at = _NUMBERS.size
        texts = []
        for _ in range(3):
            (n,) = _LEN.unpack_from(data, at)
            at += _LEN.size
            if at + n > len(data):
                return None
            texts.append(data[at:at + n].decode())
            at += n
    except (struct.error, UnicodeDecodeError):
        return None
    if at != len(data):
        return None
    gaps, account, owed = texts
    values = [*nums, gaps, account, owed]
    return {name: _text(v) for name, v in zip(TALLY_FIELDS, values, strict=True)}


def pack_tally(fields: Mapping[str, str | int | float]) -> bytes:
    """The value complete.lua would write for these fields (tools and tests: e.g. aging a session)."""
    nums = [int(fields[n]) for n in ("att", "pub", "hw", "prompt_tokens", "generated_tokens", "recomputed_tokens",
                                     "steps")]
    out = _NUMBERS.pack(*nums, float(fields["engine_seconds"]), int(fields["t"]))
    for name in ("gaps", "account", "owed"):
        b = str(fields[name]).encode()
        out += _LEN.pack(len(b)) + b
    return out


def _text(v: object) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return str(v)


def merge(session_hash: Mapping[bytes | str, bytes | str], tally: Mapping[str, str] | None) -> dict[str, str]:
    """The session's accounting now: its hash (what was folded so far) plus its open tally (added to the
    counters; positions and `t` taken from the tally). An empty dict when neither exists."""
    out = {_s(k): _s(v) for k, v in session_hash.items()}
    if tally is None:
        return out
    for name in COUNTERS:
        if name == "engine_seconds":
            out[name] = repr(float(out.get(name, 0.0)) + float(tally[name]))
        else:
            out[name] = str(int(out.get(name, 0)) + int(tally[name]))
    for name in ("att", "pub", "hw", "t", "gaps", "account", "owed"):
        if tally[name]:
            out[name] = tally[name]
    return out
