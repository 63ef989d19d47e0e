"""dgr producer: the Tracker side, which opens sessions, pushes their step jobs and reads their answers.

`Producer` (synchronous, redis-py) and `AsyncProducer` (asyncio, `redis.asyncio`) run the plans of one sans-I/O
core (producer/core.py) on their own event loops; one `ProducerSettings` configures either. Every error raised
on purpose is a `schemas.DgrError` (the producer's: `ProducerError`)."""

from .aio import AsyncProducer
from .client import Producer
from .core import ProducerCore, Run
from .errors import Backpressure, ProducerError, ResultTimeout, SessionFailed
from .placement import Choice, PlacementPolicy, SessionTemplate
from .session import HopLeg, RouteHandle, SessionHandle
from .settings import DECODE_N, ProducerSettings
from .steps import job_id
from .validate import WorkerInfo

__all__ = ["DECODE_N", "AsyncProducer", "Backpressure", "Choice", "HopLeg", "PlacementPolicy", "Producer",
           "ProducerCore", "ProducerError", "ProducerSettings", "ResultTimeout", "RouteHandle", "Run", "SessionFailed",
           "SessionHandle", "SessionTemplate", "WorkerInfo", "job_id"]
