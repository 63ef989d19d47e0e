"""A session's accounting as the completion script keeps it (docs/accounting.md): while the session is
open, a field of its worker's tally hash (`WorkerKeys.tally`); once closed, its session hash
(`WorkerKeys.session_account`), into which the tally was folded. Pure: reading Redis is the caller's."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

__all__ = ["COUNTERS", "TALLY_FIELDS", "merge", "parse_tally"]

# The tally value's fields, in order (consumer/lua/complete.lua writes the JSON array [att, pub, hw, prompt,
# gen, recomp, steps, es, t, gaps, account, owed]; t: the server's clock, unix seconds, at the session's
# last answer; gaps (result positions not published) and owed (positions not charged): '-' or 'lo:hi,...').
TALLY_FIELDS: Final = ("att", "pub", "hw", "prompt_tokens", "generated_tokens", "recomputed_tokens", "steps",
                       "engine_seconds", "t", "gaps", "account", "owed")
# What the tally adds to the session hash when folded; the other fields are positions, set, not added.
COUNTERS: Final = ("prompt_tokens", "generated_tokens", "recomputed_tokens", "steps", "engine_seconds")


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def parse_tally(raw: bytes | str | None) -> dict[str, str] | None:
    """A tally field's value as named fields, each as text (None: no field, or not a tally value)."""
    if raw is None:
        return None
    try:
        parts = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(parts, list) or len(parts) != len(TALLY_FIELDS):
        return None
    return {name: _text(v) for name, v in zip(TALLY_FIELDS, parts, strict=True)}


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
