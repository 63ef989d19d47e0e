"""Continuation jobs that arrive before their session's prompt (issue 32, the ramp).

The Tracker pushes a session's first continuation job with its opening (producer/steps.py `queue_prefill`):
a token-less decode job at the prompt's end, which feeds the token the prompt's last row samples. So the
session decodes at the call after its prefill instead of one Tracker round trip later. The two jobs travel on
different streams (decode and prefill), and a read may carry the continuation without the opening: the
scheduler wants no prefill entries while two calls' worth of prompt tokens are queued, or the opening lies
beyond the read's count. Admitted then, the continuation would be answered `state_lost` (a session this
worker does not hold) and the Tracker would replay a session that was never lost.

So such a job is held here, unanswered (its entry stays pending, as any entry read and not yet answered), until
its session's last prompt chunk is admitted, and then admitted right behind it. Bounded both ways: at most
`capacity` jobs held (past that, a job is admitted at once, as before), each for `hold_s` seconds (then it is
admitted as it is: `state_lost` if its session never came), longer while its prompt may still be unread (no
read since found the prompt streams drained, or its session is open here with its prompt short of it:
`expired`), and never past `max_hold_s`. Only a job that could be such a continuation
is held: one the Tracker marked `with_opening` (schemas/step.py: a token-less decode job of hop 0 pushed with
the opening), for a session this worker does not hold yet (nor remembers closed), holds or remembers at an older
attempt only (a replay's: its new opening has not come, and checked against the old attempt the job would be
refused), or holds with its prompt not yet queued to the job's start (the prompt's later chunks are on their
way). Continuation jobs pushed ahead later are not held: one for a session this worker does not hold (it
restarted and lost it) is answered at once, so the Tracker replays that session without waiting here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..transport.protocol import Inbound

__all__ = ["EarlySteps"]


@dataclass
class EarlySteps:
    capacity: int
    hold_s: float
    max_hold_s: float = float("inf")
    _held: dict[str, list[tuple[Inbound, float]]] = field(default_factory=dict)  # session -> (entry, since)
    _n: int = 0
    _said: set[str] = field(default_factory=set)  # job ids already reported held past hold_s (`first_overdue`)

    def __len__(self) -> int:
        return self._n

    def hold(self, session_id: str, inb: Inbound, now: float) -> bool:
        """Hold the entry for its session's prompt; False when full (admit it now)."""
        if self._n >= self.capacity:
            return False
        self._held.setdefault(session_id, []).append((inb, now))
        self._n += 1
        return True

    def release(self, session_id: str, attempt: int | None = None) -> list[Inbound]:
        """The entries held for the session, in arrival order: all of them, or only those of `attempt` (its
        prompt is queued now; a newer attempt's stay held)."""
        return self._take(session_id, lambda a: attempt is None or a == attempt)

    def release_older(self, session_id: str, attempt: int) -> list[Inbound]:
        """The entries held for the session of attempts before `attempt` (a newer attempt opens it: they are
        admitted first, as they would have been without holding, so they are answered for the old attempt)."""
        return self._take(session_id, lambda a: a < attempt)

    def _take(self, session_id: str, wanted: Callable[[int], bool]) -> list[Inbound]:
        got = self._held.get(session_id)
        if not got:
            return []
        out = [inb for inb, _ in got if wanted(_attempt(inb))]
        keep = [x for x in got if not wanted(_attempt(x[0]))]
        if keep:
            self._held[session_id] = keep
        else:
            del self._held[session_id]
        self._n -= len(out)
        return out

    def expired(self, now: float, coming: Callable[[Inbound, float], bool] = lambda _inb, _since: False
                ) -> list[Inbound]:
        """The entries held hold_s or longer, released (their sessions' prompts never came), but for those whose
        prompt is `coming` (asked with the time each was held), held until max_hold_s: the reader takes no
        prefill entries while enough prompt tokens are queued, so a wave of long prompts can leave a session's
        opening or last chunks unread for longer than hold_s, and admitted then the entry would be answered
        state_lost (a replay of a session never lost) or refused position_gap (a session being served
        ended)."""
        if not self._n:
            return []
        out: list[Inbound] = []
        for sid in [s for s, held in self._held.items() if now - held[0][1] >= self.hold_s]:
            held = self._held[sid]
            if now - held[0][1] < self.max_hold_s and all(coming(inb, since) for inb, since in held):
                continue
            out += self.release(sid)
        return out


    def first_overdue(self, job_id: str) -> bool:
        """True the first time a job is found held past hold_s (its prompt still coming), so that it is reported
        once, not at every look; bounded: the record is forgotten past 4,096 jobs."""
        if job_id in self._said:
            return False
        if len(self._said) >= 4096:
            self._said.clear()
        self._said.add(job_id)
        return True


def _attempt(inb: Inbound) -> int:
    return inb.job.attempt if inb.job is not None else -1
