"""The transport's errors (the `TransportError` branch of `DgrError`): what the worker loop must know of
its transport going wrong, without loading any of it (no Redis client here)."""

from __future__ import annotations

from schemas import TransportError

__all__ = ["EvictingRedis", "LeaseHeld", "LeaseLost", "NotDurable", "Stopping"]


class LeaseLost(TransportError):
    """Another process acquired this worker id's lease: this one must stop writing (and exit)."""


class LeaseHeld(TransportError):
    """The lease is held by another live process and the caller chose not to wait for it."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"another consumer holds this worker id's lease: {holder}")
        self.holder = holder


class EvictingRedis(TransportError):
    """Redis may evict dgr's keys at its maxmemory (consumer/transport/memory.py): the worker refuses to start."""


class Stopping(TransportError):
    """A stop was requested while the transport waited (an outage's backoff, the lease as a standby)."""


class NotDurable(TransportError):
    """Fewer replicas than `durable_replicas` acknowledged a completion within `durable_timeout_ms`: it
    has not counted yet (consumer/transport/durable.py). Ridden through as an outage: the call is re-sent."""
