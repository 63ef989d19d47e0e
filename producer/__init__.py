"""dgr producer: the Tracker-side client that opens sessions and pushes step jobs.

`Producer` (synchronous, redis-py) and `AsyncProducer` (asyncio, `redis.asyncio`; in producer.aio) are two
thin drivers over one sans-I/O core (producer.core.ProducerCore)."""

from .client import Producer
from .core import (
    Backpressure,
    ProducerCore,
    ResultTimeout,
    SessionFailed,
    SessionHandle,
    WorkerInfo,
    job_id,
)

__all__ = ["Backpressure", "Producer", "ProducerCore", "ResultTimeout", "SessionFailed", "SessionHandle",
           "WorkerInfo", "job_id"]
