"""How far the worker group is behind on one input stream, from an XLEN and an XINFO GROUPS reply.

One reading for the producer (backpressure), the worker (its lag metric) and `dgr inspect`: the group is
`dgr-workers` (schemas/keys.py: GROUP); either reply may be an error (no stream yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .keys import GROUP


def _str(x: Any) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


@dataclass(frozen=True, slots=True)
class StreamLag:
    length: int  # XLEN (0 when the stream does not exist)
    lag: int | None  # the group's 'lag' (None: no group, or Redis cannot tell)
    group: Mapping[str, Any] | None  # the group's XINFO GROUPS entry, str keys (None: no group)

    @property
    def behind(self) -> int:
        """Entries not yet delivered: the lag, or the whole length where Redis cannot tell."""
        return self.lag if self.lag is not None else self.length


def stream_lag(length: object, groups: object) -> StreamLag:
    """The dgr group's lag from an XLEN reply and an XINFO GROUPS reply (either may be an Exception)."""
    n = 0 if isinstance(length, Exception) else int(length)  # type: ignore[call-overload]
    group: dict[str, Any] | None = None
    if not isinstance(groups, Exception) and groups:
        for g in groups:  # type: ignore[attr-defined]
            entry = {_str(k): v for k, v in g.items()}
            if _str(entry.get("name", "")) == GROUP:
                group = entry
    lag = int(group["lag"]) if group is not None and group.get("lag") is not None else None
    return StreamLag(n, lag, group)
