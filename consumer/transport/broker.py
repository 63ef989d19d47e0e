"""`RedisTransport`: the worker's Redis I/O, the `Transport` the worker loop speaks to (protocol.py).
Every Redis fact of a worker lives in this package: stream names, fields, entry ids, scripts
(consumer/lua/), retries, the lease. One fused call costs at most one read (plus a bounded gather of
non-blocking reads), one completion (exactly one EVALSHA whatever the batch size) and one cancellation
check; a read that brought steps of sessions the worker does not hold costs one `checks()` more.

Exactly-once effects come from the completion script (publish.py): it acks the entries whose jobs
ended, publishes each answer once (a session's tally entry for ok answers, a `SET NX` marker for the
others) and charges it once; a completion re-sent after a reconnect changes nothing (its call guard).

Every key a script touches is passed in KEYS and all of them share the worker's hash tag, so the
scripts are Redis Cluster safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import redis

from schemas import CompatibilityKey, Phase, Signer, StepJob, WorkerKeys
from schemas.prefix import PrefixSummary
from schemas.retry import OutageListener

from ..config import TransportSettings
from .connection import RedisIO
from .intake import Intake
from .lease import Lease
from .protocol import DeadLetter, Delivery, Filing, Inbound
from .publish import Publisher
from .recovery import recover_streams
from .upkeep import Upkeep

__all__ = ["RedisTransport"]


class RedisTransport:
    """Redis I/O of one worker consumer. One thread at a time (protocol.py). The client must return
    bytes (`decode_responses=False`, the default)."""

    def __init__(self, client: redis.Redis, worker_id: str, consumer_name: str = "c0",
                 settings: TransportSettings = TransportSettings(), signer: Signer | None = None,
                 listener: OutageListener | None = None) -> None:
        """`listener`: told when a Redis outage starts and ends (the worker's metrics)."""
        self.io = RedisIO(client, worker_id, consumer_name, settings, listener)
        self.intake = Intake(self.io, signer)
        self.lease = Lease(self.io)
        self.upkeep = Upkeep(self.io, self.intake)
        self.publisher = Publisher(self.io, self.intake, self.lease)

    # ---- identity and counters
    @property
    def client(self) -> redis.Redis:
        return self.io.client

    @client.setter
    def client(self, client: redis.Redis) -> None:  # tests put a flaky client in its place
        self.io.client = client

    @property
    def instance_id(self) -> str:
        """`<host>:<pid>:<nonce>`: who holds the lease (tests pose as another host)."""
        return self.lease.instance_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self.lease.instance_id = value

    @property
    def worker_id(self) -> str:
        return self.io.worker_id

    @property
    def consumer_name(self) -> str:
        return self.io.consumer_name

    @property
    def settings(self) -> TransportSettings:
        return self.io.settings

    @property
    def keys(self) -> WorkerKeys:
        return self.io.keys

    @property
    def round_trips(self) -> int:
        return self.io.round_trips

    @property
    def outages(self) -> int:
        return self.io.outages

    @property
    def streams(self) -> list[str]:
        return self.intake.streams

    @property
    def outstanding(self) -> int:
        """Entries handed out and not yet acked by a completion."""
        return sum(len(v) for v in self.intake.outstanding.values())

    def request_stop(self) -> None:
        """End every wait at once (an outage's backoff, a standby's wait): they raise `Stopping`; a request
        hung on its socket is cut off after a grace (unblock.py)."""
        self.io.request_stop()

    # ---- the lease
    def acquire_lease(self, *, wait: bool = True, stop: Callable[[], bool] | None = None) -> str:
        self.upkeep.check_memory()  # before anything is written: EvictingRedis on a Redis that may evict it
        return self.lease.acquire(wait=wait)

    def renew_lease(self) -> None:
        self.lease.renew()

    def release_lease(self) -> None:
        self.lease.release()

    @property
    def lease_token(self) -> str | None:
        return self.lease.token

    @property
    def lease_epoch(self) -> str:
        return self.lease.epoch

    # ---- registration, liveness
    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> list[str]:
        return self.upkeep.register(keys, info)

    def heartbeat(self, info: Mapping[str, object] | None = None, summary: PrefixSummary | None = None) -> None:
        self.upkeep.heartbeat(info, summary)

    def input_lag(self) -> dict[str, dict[str, int]]:
        return self.upkeep.input_lag()

    @property
    def draining(self) -> bool:
        """`dgr ops drain` set this worker's drain key (as of the last input_lag())."""
        return self.upkeep.draining

    def trim(self) -> None:
        self.upkeep.trim()

    # ---- reading
    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        return self.intake.read(want, block_ms=block_ms, gather_ms=gather_ms, more=more)

    def read_streams(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
                     more: Callable[[list[Delivery]], bool] | None = None) -> list[Delivery]:
        return self.intake.read_streams(want, block_ms=block_ms, gather_ms=gather_ms, more=more)

    def inbound(self, d: Delivery) -> Inbound:
        return self.intake.inbound(d)

    def recover(self) -> list[Inbound]:
        kept, dead = recover_streams(self.intake)
        return [self.intake.inbound(d) for d in [*kept, *(dl.delivery for dl in dead)]]

    def recover_streams(self) -> tuple[list[Delivery], list[DeadLetter]]:
        return recover_streams(self.intake)

    @property
    def dead_lettered(self) -> deque[DeadLetter]:
        """Entries the pending re-read dead-lettered (already acked): for logs and metrics."""
        return self.intake.dead_lettered

    def cancellations(self) -> tuple[list[str], list[DeadLetter]]:
        return self.intake.cancellations()

    def read_ahead(self, want: Mapping[str, int]) -> tuple[list[Delivery], list[str], list[DeadLetter]]:
        return self.intake.read_ahead(want)

    def checks(self, steps: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        return self.upkeep.checks(steps, session_ids)

    def activation_key(self, direction: Literal["in", "out"], job_id: str) -> str:
        return self.io.keys.activations_in(job_id) if direction == "in" else self.io.keys.activations_out(job_id)

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        return self.upkeep.fetch_activations(blobs)

    # ---- completion
    def complete(self, filing: Filing) -> list[str]:
        return self.publisher.complete(filing)
