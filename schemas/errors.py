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
    """An engine call failed. `slots` names the sequence slots at fault when the engine can tell (the
    worker then retries the rest of the fused call without them)."""

    def __init__(self, message: str, slots: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.slots = tuple(slots)


class ProducerError(DgrError, RuntimeError):
    """The Tracker side could not do what it was asked (backpressure, a timeout, a failed session)."""
