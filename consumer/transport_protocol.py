"""What the worker needs from a transport, and the plain records it exchanges with one.

The worker speaks only to `Transport`: it asks for so many entries per phase and gets decoded jobs
(or why an entry is not one), hands back `Answer`s and dead letters, and never sees a stream name, an
entry's raw fields, a signature or a Redis command. `consumer.transport.RedisTransport` implements it;
tests/memory_transport.py implements it in memory for worker unit tests (as Dramatiq's broker /
worker split).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from schemas import CompatibilityKey, Phase, Reason, StepJob

from .schedule_output import Answer

__all__ = ["DeadLetter", "Delivery", "FusedCallStats", "Inbound", "Refusal", "Transport"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """One entry as the transport read it. The worker passes it back untouched and reads none of it."""

    stream: str  # input stream key (decoded str)
    entry_id: str
    fields: dict[bytes, bytes]
    digest: str  # the compatibility digest the stream is named by
    phase: Phase


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an entry is not a job: undecodable, unsigned, or beyond a wire limit."""

    reason: Reason
    detail: str
    session_id: str | None = None  # the session the entry names, when readable: its caller is told
    job_id: str | None = None


@dataclass(frozen=True, slots=True)
class Inbound:
    """One entry read for the worker: a decoded job, or the refusal that stands in for one."""

    ref: Delivery  # pass back untouched (as an Answer's ref, or in a DeadLetter)
    phase: Phase  # the phase of the stream it came on (the job may claim another: admission refuses it)
    digest: str  # the compatibility digest of that stream
    name: str  # unique per entry ("<phase>.<entry id>"): for logs, and the job id of an answer to a job with none
    job: StepJob | None
    refusal: Refusal | None = None  # set exactly when job is None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    delivery: Delivery
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class FusedCallStats:
    """Per-worker counters for one fused engine call."""

    phase: Phase
    batch_size: int  # sessions in the call
    tokens: int  # rows in the call
    engine_seconds: float


class Transport(Protocol):
    """Everything the worker loop asks of the outside world. One loop thread per instance."""

    @property
    def round_trips(self) -> int: ...

    @property
    def outages(self) -> int:
        """Outages of the backing store ridden through so far (the worker re-registers after one)."""
        ...

    def acquire_lease(self, *, wait: bool = True) -> str: ...

    def renew_lease(self) -> None: ...

    def release_lease(self) -> None: ...

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> Sequence[str]:
        """Listen for jobs of these keys, advertise them with `info`; returns names for logs. Idempotent."""
        ...

    def heartbeat(self, info: Mapping[str, object] | None = None) -> None: ...

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        """Up to want[phase] entries per phase; `more(counts read so far)` keeps a short gather going."""
        ...

    def recover(self) -> tuple[list[Inbound], list[DeadLetter]]:
        """Entries to hand out again (a dead predecessor's, a lost read's), and those given up on."""
        ...

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        """The bytes of each input activations blob (None: missing), in one round trip."""
        ...

    def checks(self, job_ids: Sequence[str], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """(job ids already answered, session ids with a cancel marker)."""
        ...

    def cancellations(self) -> list[str]: ...

    def drain_rejected_cancellations(self) -> list[DeadLetter]: ...

    def complete(self, answers: Sequence[Answer], dead_letters: Sequence[DeadLetter] = (),
                 call: FusedCallStats | None = None) -> list[bool]:
        """File every answer (each Answer.ref is the Delivery it answers) and dead letter, count the call."""
        ...

    def close_sessions(self, closures: Sequence[tuple[str, str]]) -> int: ...

    def input_lag(self) -> dict[str, dict[str, int]]:
        """Per input (an opaque label): length, lag, pending."""
        ...

    def trim(self) -> None: ...
