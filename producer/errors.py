"""What the Tracker side raises on purpose: the producer branch of the one error root (schemas.errors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import ProducerError

if TYPE_CHECKING:
    from .session import SessionHandle

__all__ = ["Backpressure", "ProducerError", "ResultTimeout", "SessionFailed"]


class Backpressure(ProducerError):
    """The target worker's input lag is over the bound (`max_lag`)."""


class ResultTimeout(ProducerError, TimeoutError):
    """A worker the session waits on answered nothing for `timeout_s` (time in a Redis outage not counted)."""


class SessionFailed(ProducerError):
    """A session ended rejected / failed / with an unrecoverable state_lost (`generate()` raises it)."""

    def __init__(self, handle: SessionHandle) -> None:
        super().__init__(f"session {handle.session_id} ended with {handle.status}"
                         + (f" ({handle.reason}: {handle.detail})" if handle.reason else ""))
        self.handle = handle
