"""dgr producer: the Tracker-side client that opens sessions and pushes step jobs."""

from .client import (
    Backpressure,
    Producer,
    ResultTimeout,
    SessionFailed,
    SessionHandle,
    WorkerInfo,
    job_id,
)

__all__ = ["Backpressure", "Producer", "ResultTimeout", "SessionFailed", "SessionHandle", "WorkerInfo", "job_id"]
