"""The worker's transport: the broker primitives the worker loop speaks to (protocol.py) and their Redis
implementation (broker.py: `RedisTransport`), split by seam: the connection and outage riding
(connection.py), the lease (lease.py), reading and decoding (intake.py), recovery (recovery.py),
filing completions (publish.py + consumer/lua/complete.lua), upkeep (upkeep.py)."""

from ..config import TransportSettings
from .broker import RedisTransport
from .connection import LeaseHeld, LeaseLost, Stopping
from .protocol import Closure, DeadLetter, Delivery, FusedCallStats, Inbound, Refusal, Transport
from .publish import COMPLETE_ARGV, FIXED_KEYS

__all__ = [
    "COMPLETE_ARGV", "FIXED_KEYS", "Closure", "DeadLetter", "Delivery", "FusedCallStats", "Inbound", "LeaseHeld",
    "LeaseLost", "RedisTransport", "Refusal", "Stopping", "Transport", "TransportSettings",
]
