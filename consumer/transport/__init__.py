"""The worker's transport: the broker primitives the worker loop speaks to (protocol.py, errors.py) and
their Redis implementation (broker.py: `RedisTransport`), split by seam: the connection and outage riding
(connection.py), the lease (lease.py), reading and decoding (intake.py), recovery (recovery.py), filing
completions (publish.py + consumer/lua/complete.lua), upkeep (upkeep.py).

The Redis implementation is loaded on first use (`consumer.transport.RedisTransport`), so the worker loop,
which needs only the protocol and the errors, loads no Redis client (tests/test_layering.py)."""

from typing import TYPE_CHECKING, Any

from ..config import TransportSettings
from .errors import EvictingRedis, LeaseHeld, LeaseLost, NotDurable, Stopping
from .protocol import Closure, DeadLetter, Delivery, Filing, FusedCallStats, Inbound, Refusal, Transport

if TYPE_CHECKING:
    from .broker import RedisTransport
    from .publish import COMPLETE_ARGV, FIXED_KEYS

__all__ = [
    "COMPLETE_ARGV", "FIXED_KEYS", "Closure", "DeadLetter", "Delivery", "EvictingRedis", "Filing", "FusedCallStats",
    "Inbound",
    "LeaseHeld", "LeaseLost", "NotDurable", "RedisTransport", "Refusal", "Stopping", "Transport", "TransportSettings",
]


def __getattr__(name: str) -> Any:
    if name == "RedisTransport":
        from .broker import RedisTransport

        return RedisTransport
    if name in ("COMPLETE_ARGV", "FIXED_KEYS"):
        from . import publish

        return getattr(publish, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
