"""Which open sessions have gone idle: no step admitted and nothing served for `idle_s`.

A client that opens sessions and never continues them would otherwise hold their slots forever; the
worker cancels the sessions this names through the normal cancellation path. Pure bookkeeping with
an injected clock (tests drive it by hand). Touching and sweeping cost O(1) per session touched or
reaped: sessions are kept in the order they were last touched, so a sweep stops at the first one
that is not idle.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

__all__ = ["IdleSessions"]


class IdleSessions:
    def __init__(self, idle_s: float, clock: Callable[[], float]) -> None:
        if idle_s <= 0:
            raise ValueError("idle_s must be > 0")
        self.idle_s = idle_s
        self.clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()  # session -> last touch, oldest first

    def __len__(self) -> int:
        return len(self._last)

    def touch(self, session_id: str) -> None:
        """The session did something (a step admitted, a step served): its idle time starts again."""
        self._last[session_id] = self.clock()
        self._last.move_to_end(session_id)

    def due(self, is_open: Callable[[str], bool], is_busy: Callable[[str], bool]) -> list[str]:
        """The open sessions idle for idle_s or longer, forgotten here; closed ones are forgotten
        silently, and busy ones (a step queued or in a call) count as touched now."""
        now = self.clock()
        out: list[str] = []
        while self._last:
            sid, last = next(iter(self._last.items()))
            if now - last < self.idle_s:
                break
            del self._last[sid]
            if not is_open(sid):
                continue
            if is_busy(sid):
                self._last[sid] = now
                continue
            out.append(sid)
        return out
