"""Boundary activations: what one route hop hands the next (docs/wire-format.md, "Activations").

A hop that is not the last answers each step with one activation row per token it was given; the
next hop takes them as its input. Rows travel as the raw little-endian bytes of a (rows, hidden_size)
array of `dtype`, either inline (base64 in the entry's `hidden` field, when the raw bytes are at most
INLINE_MAX_BYTES: a decode step) or in a blob (a Redis string in the hash tag of the worker that
reads or wrote it, with a TTL: a prefill chunk). `sha256` is over the raw bytes either way and is
checked on decode, so a truncated, stale or swapped blob is refused by name, never computed on.

Decoding never raises anything but `ActivationError` (the worker answers it `bad_activations`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from typing import Final, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from .errors import ActivationError
from .limits import (
    ACTIVATIONS_VERSION,
    INLINE_MAX_BYTES,
    MAX_ACTIVATION_BYTES,
    MAX_HIDDEN_SIZE,
    MAX_NAME_LEN,
    MAX_TOKENS_PER_JOB,
)

Dtype = Literal["f32", "f16"]
ITEMSIZE: Final[dict[str, int]] = {"f32": 4, "f16": 2}
_NP: Final[dict[str, str]] = {"f32": "<f4", "f16": "<f2"}
# base64 of INLINE_MAX_BYTES raw bytes (4 characters per 3 bytes, padded).
INLINE_MAX_CHARS: Final = 4 * ((INLINE_MAX_BYTES + 2) // 3)
_SHA256: Final = re.compile(r"[0-9a-f]{64}")

__all__ = ["INLINE_MAX_CHARS", "ITEMSIZE", "ActivationError", "Activations", "Dtype", "decode", "encode",
           "raw_bytes"]


class Activations(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """The header of one step's activations; the rows are in `data` (inline) or in the string `blob`.
    Every value is checked in `__post_init__` (built or decoded alike)."""

    dtype: Dtype
    hidden_size: int
    rows: int
    sha256: str
    data: str | None = None
    blob: str | None = None
    v: int = ACTIVATIONS_VERSION

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise ActivationError(problem)

    def _problem(self) -> str | None:
        if self.v != ACTIVATIONS_VERSION or type(self.v) is not int:
            return f"activation format version {self.v!r} is not {ACTIVATIONS_VERSION}"
        if self.dtype not in ITEMSIZE:
            return f"dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}"
        if type(self.hidden_size) is not int or not 1 <= self.hidden_size <= MAX_HIDDEN_SIZE:
            return f"hidden_size must be an int in [1, {MAX_HIDDEN_SIZE}]"
        if type(self.rows) is not int or not 1 <= self.rows <= MAX_TOKENS_PER_JOB:
            return f"rows must be an int in [1, {MAX_TOKENS_PER_JOB}]"
        if type(self.sha256) is not str or not _SHA256.fullmatch(self.sha256):
            return "sha256 is not 64 lowercase hex digits"
        if (self.data is None) == (self.blob is None):
            return "exactly one of data (inline) and blob (a key) is set"
        if self.data is not None and (type(self.data) is not str or len(self.data) > INLINE_MAX_CHARS):
            return f"inline data is not a string of at most {INLINE_MAX_CHARS} characters"
        if self.blob is not None and (type(self.blob) is not str or not 1 <= len(self.blob) <= 2 * MAX_NAME_LEN):
            return f"blob is not a key of 1 to {2 * MAX_NAME_LEN} characters"
        if self.nbytes > MAX_ACTIVATION_BYTES:
            return f"{self.nbytes} bytes of activations, over {MAX_ACTIVATION_BYTES}"
        if self.data is not None and self.nbytes > INLINE_MAX_BYTES:
            return f"{self.nbytes} bytes inline, over {INLINE_MAX_BYTES}: use a blob"
        return None

    @property
    def nbytes(self) -> int:
        """The size of the raw rows the header promises."""
        return self.rows * self.hidden_size * ITEMSIZE[self.dtype]

    @property
    def inline(self) -> bool:
        return self.data is not None

    def json(self) -> str:
        """The header as the wire carries it (strict JSON, absent fields left out)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, raw: str | bytes) -> Activations:
        """A header from its JSON; ActivationError for anything that is not one."""
        try:
            return _DECODER.decode(raw)
        except ActivationError:
            raise
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ActivationError(f"invalid activations header: {e}"[:200]) from None

    def moved(self, blob: str | None, raw: bytes | None = None) -> Activations:
        """The same rows under another home: the blob key `blob`, or inline (blob None, `raw` given) when
        they fit. What the Tracker does when it relays a hop's output to the next hop's worker."""
        if blob is None:
            if raw is None:
                raise ValueError("inline activations need their raw bytes")
            return Activations(dtype=self.dtype, hidden_size=self.hidden_size, rows=self.rows,
                               data=base64.b64encode(raw).decode("ascii"), sha256=self.sha256)
        return Activations(dtype=self.dtype, hidden_size=self.hidden_size, rows=self.rows, blob=blob,
                           sha256=self.sha256)


_DECODER: Final = msgspec.json.Decoder(Activations)


def raw_bytes(array: npt.NDArray[np.floating], dtype: Dtype) -> bytes:
    """The wire bytes of a (rows, hidden_size) array: little-endian `dtype`, C order."""
    a = np.asarray(array)
    if a.ndim != 2:
        raise ValueError(f"activations are a (rows, hidden_size) array, not shape {a.shape}")
    return np.ascontiguousarray(a, dtype=_NP[dtype]).tobytes()


def encode(array: npt.NDArray[np.floating], dtype: Dtype = "f32", *, blob: str | None = None,
           inline_max: int = INLINE_MAX_BYTES) -> tuple[Activations, bytes | None]:
    """(header, bytes to store at `blob`): inline when the raw bytes are at most `inline_max` (second item
    None), else in the blob `blob` (required then), whose bytes are returned to be written."""
    raw = raw_bytes(array, dtype)
    rows, hidden = np.asarray(array).shape
    digest = hashlib.sha256(raw).hexdigest()
    if len(raw) <= min(inline_max, INLINE_MAX_BYTES):
        return Activations(dtype=dtype, hidden_size=int(hidden), rows=int(rows),
                           data=base64.b64encode(raw).decode("ascii"), sha256=digest), None
    if blob is None:
        raise ValueError(f"{len(raw)} bytes of activations need a blob key")
    return Activations(dtype=dtype, hidden_size=int(hidden), rows=int(rows), blob=blob, sha256=digest), raw


def decode(acts: Activations, raw: bytes | None = None, *, hidden_size: int | None = None,
           dtype: Dtype | None = None) -> npt.NDArray[np.float32]:
    """The rows as a (rows, hidden_size) float32 array. `raw`: the blob's bytes (None: the blob is
    missing); ignored for inline activations. `hidden_size`/`dtype`: what the reading hop expects
    (its boundary schema). Raises ActivationError for a wrong size, schema, digest, or a NaN/inf."""
    if hidden_size is not None and acts.hidden_size != hidden_size:
        raise ActivationError(f"hidden_size {acts.hidden_size}, this hop takes {hidden_size}")
    if dtype is not None and acts.dtype != dtype:
        raise ActivationError(f"dtype {acts.dtype}, this hop takes {dtype}")
    if acts.data is not None:
        try:
            body = base64.b64decode(acts.data.encode("ascii"), validate=True)
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise ActivationError("inline data is not base64") from None
    elif raw is None:
        raise ActivationError(f"blob {acts.blob} is missing (expired, or never written)")
    else:
        body = raw
    if len(body) != acts.nbytes:
        raise ActivationError(f"{len(body)} bytes, the header says {acts.rows} x {acts.hidden_size} {acts.dtype} "
                              f"= {acts.nbytes}")
    if hashlib.sha256(body).hexdigest() != acts.sha256:
        raise ActivationError("sha256 of the rows differs from the header's")
    out = np.frombuffer(body, dtype=_NP[acts.dtype]).reshape(acts.rows, acts.hidden_size).astype(np.float32)
    if not np.isfinite(out).all():
        raise ActivationError("activations hold NaN or inf")
    return out
