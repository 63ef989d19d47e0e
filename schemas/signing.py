"""Opt-in entry authentication: an HMAC-SHA256 over every entry a worker reads (input and cancel streams).

Without it, anyone who may XADD to a worker's streams can cancel, steer or bill any session on it
(docs/security.md). With a key shared by the Tracker and the workers (`--hmac-key-file`,
`DGR_HMAC_KEY_FILE`), the writer adds a field `sig`: the hex HMAC of the stream's key name and the
entry's other fields. The worker dead-letters an entry whose `sig` is missing or wrong
(`bad_signature`) and never answers it: an answer would be written to the session the forger named
(and would store the result record of the job id it named), which is exactly what a forger wants.

What is signed: `dgr-hmac-v1`, the stream key (so an entry cannot be moved to another worker, phase,
compatibility key or from the cancel stream to an input stream), then every field but `sig`, sorted
by name, each name and value length-prefixed (so no two field maps share a message).

Keys: a key file holds one key per line (blank lines and `#` comments skipped), at least 32 bytes
each. The first signs; every one verifies, so keys rotate by adding the new key on the workers, then
putting it first on the Tracker, then removing the old one everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

__all__ = ["MIN_KEY_BYTES", "SIGNATURE_FIELD", "Signer"]

SIGNATURE_FIELD: Final = "sig"
MIN_KEY_BYTES: Final = 32
_DOMAIN: Final = b"dgr-hmac-v1"
_SIG: Final = SIGNATURE_FIELD.encode()


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def _message(stream: str, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> bytes:
    parts = [_DOMAIN, len(stream.encode()).to_bytes(4, "big"), stream.encode()]
    items = sorted((_b(k), _b(v)) for k, v in fields.items())
    for k, v in items:
        if k == _SIG:
            continue
        parts += [len(k).to_bytes(4, "big"), k, len(v).to_bytes(8, "big"), v]
    return b"".join(parts)


class Signer:
    """Signs with the first key, verifies with any of them."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("at least one HMAC key is needed")
        for k in keys:
            if len(k) < MIN_KEY_BYTES:
                raise ValueError(f"an HMAC key must be at least {MIN_KEY_BYTES} bytes (one is {len(k)})")
        self._keys = tuple(bytes(k) for k in keys)

    @classmethod
    def from_file(cls, path: str | Path) -> Signer:
        """Keys from a file, one per line (the line's bytes, without surrounding whitespace)."""
        lines = Path(path).read_bytes().splitlines()
        keys = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith(b"#")]
        if not keys:
            raise ValueError(f"{path}: no HMAC key in the file")
        return cls(keys)

    def sign(self, stream: str, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> str:
        """The hex signature of `fields` (its `sig`, if any, left out) on the stream named `stream`."""
        return hmac.new(self._keys[0], _message(stream, fields), hashlib.sha256).hexdigest()

    def signed(self, stream: str, fields: Mapping[str, str]) -> dict[str, str]:
        """`fields` with its `sig` field added."""
        return {**fields, SIGNATURE_FIELD: self.sign(stream, fields)}

    def verify(self, stream: str, fields: Mapping[bytes, bytes]) -> bool:
        """Whether the entry carries a `sig` that one of the keys made for exactly these fields on `stream`."""
        given = fields.get(_SIG)
        if given is None or len(given) != 64:
            return False
        msg = _message(stream, fields)
        return any(hmac.compare_digest(hmac.new(k, msg, hashlib.sha256).hexdigest().encode(), given)
                   for k in self._keys)
