"""Argument checks of the producer's public methods: wrong input fails here, with a message that says
what is wrong, before anything is written to Redis (an id that is not an id could build a key outside
the worker's hash tag; a token past the vocabulary only comes back as a rejection)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from schemas.limits import MAX_TOKEN_ID, is_id

__all__ = ["check_id", "check_token", "check_tokens", "vocab_size"]


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
