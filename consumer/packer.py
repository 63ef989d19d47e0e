"""The commands' bytes in one C call: redis-py's command packer less its Python pass over every argument.

redis-py's packer with hiredis (`HiredisRespSerializer.pack`) walks the arguments twice in Python (a test for
memoryviews, then each argument through its `Encoder.encode`) before `hiredis.pack_command` packs them in C. A
worker's completion call of 256 rows carries about 280 arguments (each row's session hash is a key), and that walk
cost it 465 µs a call against 93 µs for `hiredis.pack_command` alone on the same arguments (docs/benchmarks.md,
2026-12-07, a fifth session). `OneCallPacker` hands the arguments straight to hiredis when that packs them as
redis-py would: a one-word command name (redis-py splits a name with spaces into words) and arguments of the types
hiredis packs (str as UTF-8, bytes, int, float: the same bytes as redis-py's `repr` of a number, checked by
tests/test_packer.py). Anything else (a bytearray, a memoryview, a bool, None, a client with another encoding)
goes through redis-py's own packer, so its errors stay its own (hiredis refuses every type but those four, their
subclasses too, with a TypeError; it packs a memoryview's bytes, as redis-py sends them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hiredis
from redis._parsers import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer

__all__ = ["OneCallPacker", "packer_kwargs"]

_BUFFER_CUTOFF = 6000  # redis-py's own (Connection._buffer_cutoff): where its Python packer sends values apart


class OneCallPacker:
    """A redis-py command packer (the Connection's `command_packer`) for clients with the default encoding."""

    def __init__(self) -> None:
        encode = Encoder("utf-8", "strict", False).encode
        self._fallback = HiredisRespSerializer(PythonRespSerializer(_BUFFER_CUTOFF, encode).pack, encode)

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if isinstance(name, str) and name.isalpha():  # one word: redis-py's split keeps it as it is
            try:
                return [hiredis.pack_command(args)]
            except TypeError:  # a type hiredis does not pack (a bool among them: redis-py refuses it too)
                pass
        return self._fallback.pack(*args)


def packer_kwargs(client_kw: Mapping[str, Any], url_kw: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The client's keyword arguments with a `command_packer`, where its connections encode as the packer does
    (UTF-8, strict: as set in `client_kw` or in its URL's settings, `url_kw`) and nobody chose a packer already."""
    seen = {**client_kw, **(url_kw or {})}
    encoding = str(seen.get("encoding", "utf-8")).lower().replace("-", "").replace("_", "")
    if "command_packer" in seen or encoding != "utf8" or seen.get("encoding_errors", "strict") != "strict":
        return dict(client_kw)
    return {**client_kw, "command_packer": OneCallPacker()}
