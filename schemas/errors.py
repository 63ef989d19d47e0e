"""One error root for everything dgr raises on purpose (as Dramatiq's `DramatiqError`), with one branch
per part: the wire (what travels in Redis), the transport (a worker's Redis I/O), the engine, the
producer (the Tracker side). Catch `DgrError` to catch them all; each class also keeps the builtin base
its callers caught before (a `WireError` is still a `ValueError`)."""

from __future__ import annotations

from .reasons import Reason

__all__ = ["ActivationError", "DgrError", "EngineError", "ProducerError", "TransportError", "WireError"]


class DgrError(Exception):
    """The root of every error dgr raises on purpose."""


class WireError(DgrError, ValueError):
    """An entry, a job or a result that does not follow docs/wire-format.md. `reason` says what was
    wrong; `session_id` / `job_id` / `reply_to` are set when they could be read, so a worker can answer
    the session (`rejected`) rather than only dead-letter the entry."""

    def __init__(self, reason: Reason, message: str, *, session_id: str | None = None,
                 job_id: str | None = None, reply_to: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.session_id = session_id
        self.job_id = job_id
        self.reply_to = reply_to


class ActivationError(WireError):
    """A step's activations cannot be used: the worker answers the step `bad_activations`."""

    def __init__(self, message: str) -> None:
        super().__init__(Reason.BAD_ACTIVATIONS, message)


class TransportError(DgrError, RuntimeError):
    """A worker's Redis I/O cannot go on (a lease lost or held by another process)."""


class EngineError(DgrError, RuntimeError):
    """One fused call failed. The engine has put every slot back where it was before the call, except
    the slots in `lost`.

    `slots` names the slots known to be at fault (empty when the engine cannot tell); the worker then
    answers their sessions and retries the call without them, or bisects the batch.
    `reason` is the wire reason code for the sessions named in `slots`: ENGINE_ERROR unless the engine
    refused the call before running it for a reason of its own (BAD_TOKEN, POSITION_GAP, TOO_LONG,
    BAD_ACTIVATIONS).
    `lost` (a subset of `slots`): slots whose state could not be put back (a recurrent or hybrid state
    moved by the failed call, with no snapshot to restore; consumer/engines/state.py). The engine has
    emptied them (next position 0): their sessions are answered `state_lost` and replayed.
    """

    def __init__(self, message: str, slots: tuple[int, ...] = (), *, reason: Reason = Reason.ENGINE_ERROR,
                 lost: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        if not set(lost) <= set(slots):
            raise ValueError(f"lost slots {lost} must be among the slots named {slots}")
        self.slots = tuple(slots)
        self.reason = reason
        self.lost = tuple(lost)


class ProducerError(DgrError, RuntimeError):
    """The Tracker side could not do what it was asked (backpressure, a timeout, a failed session)."""
