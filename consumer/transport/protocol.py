"""What the worker needs from a transport, and the plain records it exchanges with one.

The worker speaks only to `Transport`, a broker of a few primitives (as Dramatiq's broker / worker
split): it asks for so many entries per phase and gets decoded jobs (or why an entry is not one), hands
back `Answer`s, dead letters, closures and deliveries to ack, and never sees a stream name, an entry's
raw fields, an entry id, a signature or a Redis command. `consumer.transport.RedisTransport`
implements it; tests/memory_transport.py implements it in memory for worker unit tests.

Thread rule: a transport is used by one thread at a time. The worker calls it from its loop, or hands
whole calls (`read`, `complete`) to its one I/O thread and waits for that thread before calling again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from schemas import CompatibilityKey, Phase, Reason, StepJob
from schemas.prefix import PrefixSummary

from ..sched.outputs import Answer

__all__ = ["Closure", "DeadLetter", "Delivery", "Filing", "FusedCallStats", "Inbound", "Refusal", "Transport"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """One entry as the transport read it. The worker passes it back untouched and reads none of it."""

    stream: str  # input stream key (decoded str)
    entry_id: str
    fields: dict[bytes, bytes]
    digest: str  # the compatibility digest the stream is named by
    phase: Phase
    # Set when the transport gave up on the entry (delivered more than max_deliveries times: why): already
    # dead-lettered and acked, handed to the worker once only so that its session is answered (admission).
    given_up: str = ""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an entry is not a job: undecodable, unsigned, or beyond a wire limit."""

    reason: Reason
    detail: str
    session_id: str | None = None  # the session the entry names, when readable: its caller is told
    job_id: str | None = None
    reply_to: str | None = None  # the result stream it names, when readable


@dataclass(frozen=True, slots=True)
class Inbound:
    """One entry read for the worker: a decoded job, or the refusal that stands in for one."""

    ref: Delivery  # pass back untouched (as an Answer's ref, in a DeadLetter, or to ack)
    phase: Phase  # the phase of the stream it came on (the job may claim another: admission refuses it)
    digest: str  # the compatibility digest of that stream
    name: str  # unique per entry ("<phase>.<entry id>"): for logs, and the job id of an answer to a job with none
    job: StepJob | None
    refusal: Refusal | None = None  # set exactly when job is None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry the worker gives up on: filed to the dead-letter stream, its delivery acked."""

    delivery: Delivery
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class Closure:
    """A session's accounting is closed (docs/accounting.md): it finished, was cancelled, or an engine
    call failed on it. `account_id`: its billing account, when the worker held it."""

    session_id: str
    kind: Literal["finished", "cancelled", "failed"]
    account_id: str | None = None


@dataclass(frozen=True, slots=True)
class FusedCallStats:
    """Per-worker counters for one fused engine call."""

    phase: Phase
    batch_size: int  # sessions in the call
    tokens: int  # rows in the call
    engine_seconds: float


@dataclass(frozen=True, slots=True)
class Filing:
    """Everything one completion call settles: the one answer type from the worker to the transport, built
    once per call. `answers`: every answer (published once, charged once; its delivery acked when it is its
    job's last), `dead_letters`, `closures` not carried by an answer, `acks`: deliveries to ack without an
    answer (their job was answered by an earlier process), `call`: the fused call's counters. The transport
    encodes it in one pure function (consumer/transport/publish.py `encode_filing`)."""

    answers: Sequence[Answer] = ()
    dead_letters: Sequence[DeadLetter] = ()
    closures: Sequence[Closure] = ()
    acks: Sequence[Delivery] = ()
    call: FusedCallStats | None = None

    def __bool__(self) -> bool:
        return bool(self.answers or self.dead_letters or self.closures or self.acks or self.call)


class Transport(Protocol):
    """Everything the worker loop asks of the outside world. One thread at a time (module docstring)."""

    @property
    def round_trips(self) -> int: ...

    @property
    def outages(self) -> int:
        """Outages of the backing store ridden through so far (the worker re-registers after one)."""
        ...

    def acquire_lease(self, *, wait: bool = True, stop: Callable[[], bool] | None = None) -> str: ...

    def renew_lease(self) -> None: ...

    def release_lease(self) -> None: ...

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> Sequence[str]:
        """Listen for jobs of these keys, advertise them with `info`; returns names for logs. Idempotent."""
        ...

    def heartbeat(self, info: Mapping[str, object] | None = None, summary: PrefixSummary | None = None) -> None:
        """The worker is alive, with `info`; `summary`: its prefix summary (the input of placement)."""
        ...

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        """Up to want[phase] entries per phase; `more(counts read so far)` keeps a short gather going."""
        ...

    def read_streams(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
                     more: Callable[[list[Delivery]], bool] | None = None) -> list[Delivery]:
        """Up to want[stream] entries of each named input stream (`register` returned the names), not yet
        decoded: a worker of several engines reads several streams per phase in one read."""
        ...

    def inbound(self, d: Delivery) -> Inbound:
        """One entry read by `read_streams`, decoded (a job, or why it is refused)."""
        ...

    def recover(self) -> list[Inbound]:
        """Entries to hand out again (a dead predecessor's, a lost read's), and those given up on (their
        `ref.given_up` set: already dead-lettered and acked)."""
        ...

    def activation_key(self, direction: Literal["in", "out"], job_id: str) -> str:
        """The key of a job's input ("in": written by the Tracker) or output ("out": written by the
        completion) activations on this worker (route hops)."""
        ...

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        """The bytes of each input activations blob (None: missing), in one round trip."""
        ...

    def checks(self, steps: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """(the job ids of the steps already answered, by this process or an earlier one; the session ids
        with a cancel marker)."""
        ...

    def cancellations(self) -> tuple[list[str], list[DeadLetter]]:
        """Session ids cancelled since the last call, and the cancel entries refused (to dead-letter)."""
        ...

    def read_ahead(self, want: Mapping[str, int]) -> tuple[list[Delivery], list[str], list[DeadLetter]]:
        """`read_streams(want, block_ms=0, gather_ms=0)` and `cancellations()`, in one round trip where the store
        allows: what the worker reads while the engine computes, every call."""
        ...

    def complete(self, filing: Filing) -> object:
        """File one completion call: all of `filing` at once (one atomic step of the backing store)."""
        ...

    def input_lag(self) -> dict[str, dict[str, int]]:
        """Per input (an opaque label): length, lag, pending."""
        ...

    def trim(self) -> None: ...
