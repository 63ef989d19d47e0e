"""Argument checks of the producer's public methods, and what a worker advertises: wrong input fails here, with a
message that says what is wrong, before anything is written to Redis (an id that is not an id could build a key
outside the worker's hash tag; a token past the vocabulary only comes back as a rejection)."""

from __future__ import annotations

import json
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from schemas import CompatibilityKey, Reason, WireError
from schemas.limits import MAX_TOKEN_ID, WIRE_VERSION, is_id

__all__ = ["WorkerInfo", "check_id", "check_token", "check_tokens", "vocab_size"]


def check_id(value: object, what: str) -> str:
    """`value` if it is a whole id (schemas.limits.is_id), else ValueError (TypeError if not a str)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not is_id(value):
        raise ValueError(f"{what} {value[:80]!r} is not an id: 1-64 ASCII letters, digits, '_', '.', '-', "
                         "starting with a letter or digit")
    return value


def check_token(value: object, vocab: int | None, what: str = "token") -> int:
    """A token id as a plain int: any integer type (numpy's included, bool not), in [0, vocab)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    t = int(value)
    top = min(MAX_TOKEN_ID + 1, vocab) if vocab else MAX_TOKEN_ID + 1
    if not 0 <= t < top:
        raise ValueError(f"{what} {t} is outside [0, {top})" + (" (the worker's vocabulary)" if vocab else ""))
    return t


def check_tokens(values: Iterable[object], vocab: int | None, what: str = "prompt") -> tuple[int, ...]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of token ids, not {type(values).__name__}")
    return tuple(check_token(v, vocab, f"{what} tokens[{i}]") for i, v in enumerate(values))


def vocab_size(info: dict[str, Any] | None) -> int | None:
    """The vocabulary a worker advertises (its spec's info), when it does."""
    v = (info or {}).get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


@dataclass
class WorkerInfo:
    """A worker's advertisement: its compatibility keys and info, and its heartbeat."""

    worker_id: str
    keys: list[CompatibilityKey]
    info: dict[str, Any]
    alive: bool  # the heartbeat key exists (it expires ~10 s after the last beat)
    heartbeat_age_s: float | None
    heartbeat: dict[str, Any] = field(default_factory=dict)

    @property
    def digests(self) -> set[str]:
        return {k.digest for k in self.keys}

    def check_wire(self) -> WorkerInfo:
        """Itself, when it speaks this producer's wire version; a worker advertising another (or none) is refused
        by name (reason schema_version), never driven silently."""
        v = self.info.get("wire_version")
        if v != WIRE_VERSION:
            raise WireError(Reason.SCHEMA_VERSION, f"worker {self.worker_id!r} speaks wire version {v!r}, this "
                                                   f"producer {WIRE_VERSION} (docs/wire-format.md)")
        return self

    @staticmethod
    def parse(worker_id: str, spec_raw: bytes | str | None, hb_raw: bytes | str | None) -> WorkerInfo | None:
        """From the worker's `spec` and heartbeat keys; None when it never advertised."""
        if spec_raw is None:
            return None
        spec = json.loads(spec_raw)
        keys = [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec.get("keys", [])]
        hb = json.loads(hb_raw) if hb_raw is not None else {}
        age = max(0.0, time.time() - float(hb["ts"])) if "ts" in hb else None
        return WorkerInfo(worker_id=worker_id, keys=keys, info=dict(spec.get("info", {})),
                          alive=hb_raw is not None, heartbeat_age_s=age, heartbeat=hb)
