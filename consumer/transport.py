"""The worker's Redis I/O: read step jobs, answer them, recover, dead-letter, count. No engine here.

`RedisTransport` implements consumer/transport_protocol.py's `Transport`: the worker loop asks it for
entries per phase and gets decoded jobs, and knows no stream name nor Redis command. One fused batch costs one read
(plus a bounded gather of non-blocking reads), one `complete()` (exactly one EVALSHA whatever the
batch size) and at most one `cancellations()` check; a read that brought openings of sessions the
worker does not hold costs one `checks()` more (answered already? cancel marker?).

Delivery is at least once: an entry stays in this consumer's pending list until `complete()` acks
it. Exactly-once *effects* come from the completion script: it acks the entry, and the result record
`SET NX` says whether this job id was ever answered; only then are the result published and the
counters moved. Replaying a completion, or completing a second entry that carries an already
answered job id, changes nothing; a completion whose entry Redis no longer lists as pending (a
restart lost it) still publishes its answer once.

Every key a script touches is passed in KEYS and all of them share the worker's hash tag, so the
scripts are Redis Cluster safe. Scripts live in `consumer/lua/*.lua`.

Riding through Redis faults: every Redis call goes through `_io` (schemas/retry.py), which retries
connection errors, timeouts, READONLY / LOADING / MASTERDOWN / TRYAGAIN / CLUSTERDOWN replies with
exponential backoff and jitter for at most `outage_max_s`, logging one line when an outage starts and
one when it ends (past the bound it logs and re-raises). The caller's state is untouched by an
outage: a read is simply late, a completion is re-sent as is (the completion script is idempotent by
job id). `outages` counts the outages seen, so
the worker can re-advertise and sweep once Redis is back (a restarted Redis may have lost the tail of
its data set).

One live consumer per worker id: `acquire_lease()` takes `keys.lease` (SET NX PX through a script that
also bumps `keys.lease_epoch`), `renew_lease()` keeps it, `release_lease()` gives it back. While a
lease is held, every completion checks it in the same script (`lease.lua`): a process that lost the
lease to another (paused, partitioned) writes nothing and gets `LeaseLost`.

Recovery by ownership (`recover()`): the pending entries of every other consumer name of the group
are claimed (the lease holder is the only live consumer), this consumer's own entries are never
taken away however long they wait, and own pending entries that the worker does not hold (a reply
lost in a reconnect, a fenced predecessor's read under the same name) are handed out again.

Pending re-read (what the worker author must know): the first `read()` calls after a
`RedisTransport` is made re-read this consumer's own pending entries (XREADGROUP id `0`, then the last
id seen) before any new entry, until each stream's pending list is drained; only then do reads switch
to `>`. Entries already delivered more than `max_deliveries` times are dead-lettered on the way
(`too_many_deliveries`) instead of being handed out again, so a poison entry that crashes the worker
cannot crash it forever. A pending entry whose stream entry was trimmed comes back with empty
`fields` (complete it as a malformed dead letter).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import redis

from schemas import (
    GROUP,
    CompatibilityKey,
    Phase,
    Reason,
    Signer,
    StepResult,
    WireError,
    WorkerKeys,
    parse_input_stream,
)
from schemas.keys import WORKERS_INDEX
from schemas.lag import stream_lag
from schemas.limits import ACTIVATION_TTL_S, MAX_FIELD_BYTES
from schemas.retry import OutageRider, RetryPolicy
from schemas.wire import cancel_from_fields, job_from_fields, result_to_fields

from .config import TransportSettings
from .lua import load_lua, script_source
from .schedule_output import Answer
from .transport_protocol import DeadLetter, Delivery, FusedCallStats, Inbound, Refusal

__all__ = [
    "COMPLETE_ARGV", "COMPLETION_ARGV", "DEAD_LETTER_ARGV", "FUSED_CALL_ARGV", "Completion", "DeadLetter",
    "Delivery", "FusedCallStats", "LeaseHeld", "LeaseLost", "RedisTransport", "TransportSettings",
    "completion_of", "load_lua",
]

log = logging.getLogger("dgr.transport")
T = TypeVar("T")

MAX_DEAD_LETTER_FIELDS = 64  # original fields copied into a dead letter (a malformed entry may have many)
# Bytes of the original entry a dead letter written by complete() keeps, all fields together: more
# than any valid entry (4096 tokens + a SessionSpec), so a dead letter can still be replayed, yet a
# flood of huge malformed entries costs the dead-letter stream at most this much per entry.
MAX_DEAD_LETTER_BYTES = 2 * MAX_FIELD_BYTES
_DETAIL_MAX = 1024

# The completion script's ARGV layout (consumer/lua/complete.lua's header; tests/test_lua.py checks
# that both say the same): the head, then per completion, per dead letter, and the fused call.
COMPLETE_ARGV = ("group", "result_ttl_s", "result_maxlen", "dlq_maxlen", "n_completions", "n_dead_letters",
                 "has_call", "reject_ttl_s", "lease_token", "lease_epoch", "lease_ms", "act_ttl_s")
COMPLETION_ARGV = ("stream_k", "entry_id", "record_k", "record_value", "results_k", "session_k", "account_k",
                   "account_id", "status", "phase", "prompt_tokens", "generated_tokens", "engine_seconds",
                   "close", "start", "replay", "in_blob_k", "out_blob_k", "out_blob",
                   "nf")  # then nf field/value pairs
DEAD_LETTER_ARGV = ("stream_k", "entry_id", "nf")  # then nf field/value pairs
FUSED_CALL_ARGV = ("phase", "batch_size", "tokens", "engine_seconds")


def _argv(layout: tuple[str, ...], **values: str | int | bytes) -> list[str | int | bytes]:
    """`values` in the order `layout` names them (every name given once, no other)."""
    if values.keys() != set(layout):
        raise ValueError(f"ARGV layout {layout} given {sorted(values)}")
    return [values[name] for name in layout]


class LeaseLost(RuntimeError):
    """Another process acquired this worker id's lease: this one must stop writing (and exit)."""


class LeaseHeld(RuntimeError):
    """The lease is held by another live process and the caller chose not to wait for it."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"another consumer holds this worker id's lease: {holder}")
        self.holder = holder


def _pid_gone(pid: int) -> bool:
    """The process is gone (or a zombie waiting to be reaped) on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True, slots=True)
class Completion:
    """The completion script's record of one answer (ack + first time only: store, publish, count):
    an `Answer` with its delivery and what the accounting rules need spelled out."""

    delivery: Delivery
    result: StepResult  # its session_id names the result stream
    account_id: str | None  # billing account to charge (None: session unknown -> no account counters)
    phase: Phase
    close: Literal["finished", "cancelled"] | None = None  # marks the session's accounting closed
    start: int = 0  # the job's first position (for the recomputation rule of a replay)
    replay: bool = False  # a prefill job of attempt > 0: positions already charged count as recomputed
    in_blob: str | None = None  # the job's input activations blob: deleted once the job is answered
    out_blob: bytes | None = None  # a non-last hop's output rows, SET at result.hidden.blob with the first answer


def completion_of(a: Answer) -> Completion:
    """The completion record of an answer whose ref is the Delivery it answers."""
    d = a.ref
    if not isinstance(d, Delivery):
        raise TypeError(f"an answer's ref must be the Delivery it answers, not {type(d).__name__}")
    job = a.job
    phase = job.phase if job is not None else d.phase
    start = job.start_position if job is not None else 0
    replay = job is not None and job.phase == "prefill" and job.attempt > 0
    in_blob = job.hidden.blob if job is not None and job.hidden is not None else None
    return Completion(d, a.result, a.account_id, phase, a.close, start=start, replay=replay, in_blob=in_blob,
                      out_blob=a.blob)




@dataclass(slots=True)
class _Keys:
    """KEYS of one script call, each once; ARGV refers to them by 1-based index."""

    keys: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    def __call__(self, key: str) -> int:
        i = self.index.get(key)
        if i is None:
            self.keys.append(key)
            i = self.index[key] = len(self.keys)
        return i


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _b(x: bytes | str) -> bytes:
    return x if isinstance(x, bytes) else x.encode()


def _streams(resp: Any) -> Iterator[tuple[bytes | str, list[tuple[Any, Any]]]]:
    """(name, entries) of an XREAD/XREADGROUP reply, RESP2 (list) or RESP3 (dict)."""
    if not resp:
        return
    if isinstance(resp, dict):
        for name, value in resp.items():
            entries = value[0] if value and isinstance(value[0], list) else value
            yield name, entries
    else:
        for name, entries in resp:
            yield name, entries


def _no_group(e: redis.ResponseError) -> bool:
    """The stream or its group is gone."""
    return "NOGROUP" in str(e)


def _pairs(flat: Sequence[bytes] | None) -> dict[bytes, bytes]:
    if not flat:
        return {}
    it = iter(flat)
    return {_b(k): _b(v) for k, v in zip(it, it, strict=False)}


def _fields(fields: Mapping[bytes, bytes] | None) -> dict[bytes, bytes]:
    if not fields:
        return {}
    # The client returns bytes (decode_responses=False is checked at construction): usually a copy is all.
    if all(type(k) is bytes and type(v) is bytes for k, v in fields.items()):
        return dict(fields)
    return {_b(k): _b(v) for k, v in fields.items()}


class RedisTransport:
    """Redis I/O of one worker consumer. Not thread-safe: one loop thread per instance.

    The client must return bytes (`decode_responses=False`, the default).
    """

    def __init__(self, client: redis.Redis, worker_id: str, consumer_name: str = "c0",
                 settings: TransportSettings = TransportSettings(), signer: Signer | None = None) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisTransport needs a client with decode_responses=False")
        self.client = client
        self.worker_id = worker_id
        self.consumer_name = consumer_name
        self.settings = settings
        self.signer = signer  # set: every input and cancel entry must carry a valid HMAC (schemas/signing.py)
        self.keys = WorkerKeys(worker_id)
        self.streams: list[str] = []  # registered input streams
        self._meta: dict[str, tuple[str, Phase]] = {}  # stream -> (digest, phase)
        self._by_phase: dict[Phase, str] = {}  # phase -> the registered input stream of that phase
        self._cursor: dict[str, str] = {}  # stream -> last own pending id re-read
        self._drained: set[str] = set()
        self._recovered: dict[str, set[str]] = {}  # ids recover() handed out, while not drained
        self._cancel_cursor = "0-0"
        # Entries handed out (read, recovered) and not yet passed back to complete(), per stream: what
        # the worker holds. recover() re-delivers own pending entries that are not in here.
        self._outstanding: dict[str, set[str]] = {}
        self._rider = OutageRider(RetryPolicy(settings.outage_max_s, settings.retry_base_s, settings.retry_cap_s),
                                  log, f"worker {worker_id}")
        self.lease_token: str | None = None
        self.lease_epoch = ""
        self.instance_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.round_trips = 0  # requests sent to Redis (a pipeline or a script counts as one)
        # Entries read() dead-lettered on its pending re-read (already in the dead-letter stream and
        # acked): for logs and metrics; the newest 1000 are kept, clear it freely.
        self.dead_lettered: deque[DeadLetter] = deque(maxlen=1000)
        # Cancellation entries cancellations() could not take (undecodable, unsigned): the worker passes
        # them to complete() as dead letters (drain_rejected_cancellations).
        self._rejected_cancels: list[DeadLetter] = []
        self._complete = client.register_script(script_source("complete"))
        self._pending = client.register_script(script_source("pending"))
        self._recover = client.register_script(script_source("recover"))
        self._acquire = client.register_script(script_source("acquire"))
        self._renew = client.register_script(script_source("renew"))
        self._release = client.register_script(script_source("release"))
        self._close = client.register_script(script_source("close"))

    # ---------------------------------------------------------------- riding through outages

    def _io(self, fn: Callable[[], T]) -> T:
        """fn(), retried through a Redis outage (see the module docstring and schemas/retry.py)."""
        return self._rider.call(fn)

    @property
    def outages(self) -> int:
        """Redis outages ridden through (unavailable, then back)."""
        return self._rider.outages

    # ---------------------------------------------------------------- the lease

    def acquire_lease(self, *, wait: bool = True) -> str:
        """Take this worker id's lease. Held by a live process: wait=True polls as a standby (one log
        line) until it is free; wait=False raises LeaseHeld. A holder on this host whose process is
        gone (kill -9, then a restart) is replaced at once rather than after the lease lapses."""
        st = self.settings
        keys = [self.keys.lease, self.keys.lease_epoch]
        steal = ""
        waiting_logged = False
        while True:
            ok, value = self._io(partial(self._acquire, keys=keys, args=[self.instance_id, st.lease_ms, steal]))
            value = _s(value)
            if int(ok) == 1:
                self.lease_token = value
                self.lease_epoch = value.split(":", 1)[0]
                log.info("lease acquired", extra={"worker": self.worker_id, "lease": value,
                                                  "replaced": steal or None})
                return value
            if self._holder_gone(value):
                steal = value
                continue
            steal = ""
            if not wait:
                raise LeaseHeld(value)
            if not waiting_logged:
                log.warning("another consumer holds this worker id: waiting as standby", extra={
                    "worker": self.worker_id, "holder": value, "lease_ms": st.lease_ms})
                waiting_logged = True
            time.sleep(min(1.0, st.lease_ms / 4000))

    @staticmethod
    def _holder_gone(token: str) -> bool:
        parts = token.split(":")
        if len(parts) != 4 or parts[1] != socket.gethostname() or not parts[2].isdigit():
            return False
        pid = int(parts[2])
        # Our own pid under another token: a container restarted with the same pid.
        return pid == os.getpid() or _pid_gone(pid)

    def renew_lease(self) -> None:
        """Extend the lease (taking it back if it lapsed and nobody took it). LeaseLost if another did."""
        if self.lease_token is None:
            return
        keys = [self.keys.lease, self.keys.lease_epoch]
        args: list[str | int] = [self.lease_token, self.lease_epoch, self.settings.lease_ms]
        got = int(self._io(partial(self._renew, keys=keys, args=args)))
        if got == 0:
            raise LeaseLost(f"worker {self.worker_id}: the lease was taken over by another consumer")
        if got == 2:
            log.warning("lease had lapsed (a pause or an outage longer than the lease); nobody took it: "
                        "taken back", extra={"worker": self.worker_id, "lease": self.lease_token})

    def release_lease(self) -> None:
        """Give the lease back (clean exit), if still ours."""
        if self.lease_token is None:
            return
        token, self.lease_token = self.lease_token, None
        self._io(lambda: self._release(keys=[self.keys.lease], args=[token]))

    # ---------------------------------------------------------------- registration, liveness

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> list[str]:
        """Create the consumer group on every key's input stream (id 0, MKSTREAM; BUSYGROUP ignored),
        advertise the keys and `info` at `keys.spec` (JSON), SADD the worker to WORKERS_INDEX, load
        the scripts. Returns the stream names. Idempotent."""
        streams = list(dict.fromkeys(self.keys.input_stream(k.digest, k.phase) for k in keys))
        for s in streams:
            self._stream_meta(s)
        self._create_groups(streams)
        spec = {
            "worker_id": self.worker_id,
            "keys": [k.model_dump(mode="json") for k in keys],
            "streams": streams,
            "info": dict(info),
            "registered_at": time.time(),
        }
        body = json.dumps(spec, default=str, separators=(",", ":"))

        def advertise() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.keys.spec, body)
            pipe.sadd(WORKERS_INDEX, self.worker_id)
            pipe.execute()
            for script in (self._complete, self._pending, self._recover):
                self.client.script_load(script.script)  # so the first complete() is one EVALSHA

        self._io(advertise)
        for s in streams:
            if s not in self.streams:
                self.streams.append(s)
            self._by_phase[self._meta[s][1]] = s
        return streams

    def heartbeat(self, info: Mapping[str, object] | None = None) -> None:
        """SET keys.heartbeat to {ts, worker_id, consumer, **info} (JSON), EX heartbeat_ttl_s."""
        body = {"ts": time.time(), "worker_id": self.worker_id, "consumer": self.consumer_name,
                **(info or {})}
        raw = json.dumps(body, default=str, separators=(",", ":"))
        self._io(lambda: self.client.set(self.keys.heartbeat, raw, ex=self.settings.heartbeat_ttl_s))

    def _create_groups(self, streams: Iterable[str]) -> None:
        names = list(streams)

        def create() -> None:
            pipe = self.client.pipeline(transaction=False)
            for s in names:
                pipe.xgroup_create(s, GROUP, id="0", mkstream=True)
            for r in pipe.execute(raise_on_error=False):
                if isinstance(r, Exception) and "BUSYGROUP" not in str(r):
                    raise r

        self._io(create)

    def _stream_meta(self, stream: str) -> tuple[str, Phase]:
        m = self._meta.get(stream)
        if m is None:
            parsed = parse_input_stream(stream)
            if parsed is None or parsed[0] != self.worker_id:
                raise ValueError(f"{stream!r} is not an input stream of worker {self.worker_id!r}")
            m = self._meta[stream] = (parsed[1], parsed[2])
        return m

    def _delivery(self, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes], *,
                  held: bool = True) -> Delivery:
        """held: handed to the worker, which will pass it back to complete() (False: already acked)."""
        digest, phase = self._meta[stream]
        eid = _s(entry_id)
        if held:
            self._outstanding.setdefault(stream, set()).add(eid)
        return Delivery(stream=stream, entry_id=eid, fields=fields, digest=digest, phase=phase)

    @property
    def outstanding(self) -> int:
        """Entries handed out and not yet passed back to complete()."""
        return sum(len(v) for v in self._outstanding.values())

    # ---------------------------------------------------------------- reading

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        """The Transport read: up to want[phase] entries of each registered phase's stream (read_streams),
        each decoded (`inbound`). `more` sees the entries read so far, counted by phase."""
        counts = {self._by_phase[p]: n for p, n in want.items() if n > 0 and p in self._by_phase}
        if not counts:
            return []
        def gather(ds: list[Delivery]) -> bool:
            assert more is not None
            by_phase: dict[Phase, int] = {}
            for d in ds:
                by_phase[d.phase] = by_phase.get(d.phase, 0) + 1
            return more(by_phase)

        got = self.read_streams(counts, block_ms=block_ms, gather_ms=gather_ms,
                                more=gather if more is not None else None)
        return [self.inbound(d) for d in got]

    def inbound(self, d: Delivery) -> Inbound:
        """Decode one entry: its HMAC checked first when a signer is set (a forged entry is never
        answered: the answer would go to whichever session the forger named), then the strict wire
        parse. Never raises: whatever its bytes, an entry becomes a job or a refusal."""
        name = f"{d.phase}.{d.entry_id}"
        try:
            if self.signer is not None and not self.signer.verify(d.stream, d.fields):
                return Inbound(d, d.phase, d.digest, name, None, Refusal(Reason.BAD_SIGNATURE, "missing or wrong HMAC"))
            return Inbound(d, d.phase, d.digest, name, job_from_fields(d.fields))
        except WireError as e:
            return Inbound(d, d.phase, d.digest, name, None, Refusal(e.reason, str(e), e.session_id, e.job_id))
        except Exception as e:
            log.warning("entry refused by the per-entry guard", exc_info=True,
                        extra={"stream": d.stream, "entry_id": d.entry_id})
            return Inbound(d, d.phase, d.digest, name, None,
                           Refusal(Reason.MALFORMED, f"unexpected {type(e).__name__}: {e}"[:200]))

    def read_streams(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[list[Delivery]], bool] | None = None) -> list[Delivery]:
        """Up to want[stream] entries of each stream (streams with count 0 are not read).

        1. This consumer's own pending entries not yet re-read (after start, once, until drained).
        2. New entries ('>'): one multi-stream XREADGROUP, with BLOCK block_ms when step 1 had
           nothing (block_ms <= 0: do not block).
        3. After a wake-up (something was had), a gather loop of non-blocking reads while
           `more(deliveries_so_far)` (default: some stream still under its count) and gather_ms
           has not passed; every stream stays capped at its count.
        """
        block = self.settings.block_ms if block_ms is None else block_ms
        gather = self.settings.gather_ms if gather_ms is None else gather_ms
        remaining: dict[str, int] = {}
        for stream, n in want.items():
            if n > 0:
                s = _s(stream)
                self._stream_meta(s)
                remaining[s] = remaining.get(s, 0) + n
        if not remaining:
            return []
        out: list[Delivery] = []
        undrained = [s for s in remaining if s not in self._drained]
        if undrained:
            out += self._read_pending(undrained, remaining)
        if any(n > 0 for n in remaining.values()):
            out += self._read_new(remaining, block=0 if out else block)
        if not out or gather <= 0:
            return out
        deadline = time.monotonic() + gather / 1000.0
        pause = gather / 4000.0
        while any(n > 0 for n in remaining.values()) and (more is None or more(out)):
            now = time.monotonic()
            if now >= deadline:
                break
            got = self._read_new(remaining, block=0)
            if got:
                out += got
            else:
                time.sleep(min(pause, deadline - now))
        return out

    def _read_pending(self, streams: list[str], remaining: dict[str, int]) -> list[Delivery]:
        args: list[str | int] = [GROUP, self.consumer_name, self.settings.max_deliveries,
                                 self.settings.dlq_maxlen, MAX_DEAD_LETTER_FIELDS]
        asked = {s: remaining[s] for s in streams}
        for s in streams:
            args += [self._cursor.get(s, "0"), asked[s]]
        reply = self._call(self._pending, [self.keys.dead_letters, *streams], args, streams)
        out: list[Delivery] = []
        for s, (kept, dead, scanned, last) in zip(streams, reply, strict=True):
            skip = self._recovered.get(s, set())
            for entry_id, flat in kept:
                d = self._delivery(s, entry_id, _pairs(flat))
                if d.entry_id not in skip:
                    out.append(d)
                    remaining[s] -= 1
            for entry_id, n, flat in dead:
                d = self._delivery(s, entry_id, _pairs(flat), held=False)
                self.dead_lettered.append(DeadLetter(d, Reason.TOO_MANY_DELIVERIES,
                                                     f"delivered {_s(n)} times (max {self.settings.max_deliveries})"))
            if int(scanned) < asked[s]:
                self._drained.add(s)
                self._cursor.pop(s, None)
                self._recovered.pop(s, None)
            else:
                self._cursor[s] = _s(last)
        return out

    def _read_new(self, remaining: dict[str, int], *, block: int) -> list[Delivery]:
        """'>' reads of every stream still under its count, capped at that count. One round trip
        when nothing blocks; when all counts are equal, one command even when blocking."""
        fresh = {s: n for s, n in remaining.items() if n > 0}
        if not fresh:
            return []
        by_count: dict[int, dict[str, str]] = {}
        for s, n in fresh.items():
            by_count.setdefault(n, {})[s] = ">"
        self.round_trips += 1
        if len(by_count) == 1:
            ((count, ids),) = by_count.items()
            resp = self._xreadgroup(ids, count, block if block > 0 else None)
            return self._take(resp, remaining)

        def read_all() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for count, ids in by_count.items():
                pipe.xreadgroup(GROUP, self.consumer_name, ids, count=count)  # type: ignore[arg-type]
            return pipe.execute(raise_on_error=False)

        out: list[Delivery] = []
        lost_group = False
        for resp in self._io(read_all):  # the replies that worked count, entries were taken
            if isinstance(resp, redis.ResponseError) and _no_group(resp):
                lost_group = True
            elif isinstance(resp, Exception):
                raise resp
            else:
                out += self._take(resp, remaining)
        if lost_group:
            self._create_groups(fresh)
        if out or block <= 0:
            return out
        # Nothing waiting: block on all of them with the smallest count (never over any cap).
        resp = self._xreadgroup({s: ">" for s in fresh}, min(fresh.values()), block)
        return self._take(resp, remaining)

    def _xreadgroup(self, ids: dict[str, str], count: int, block: int | None) -> Any:
        try:
            return self._io(lambda: self.client.xreadgroup(GROUP, self.consumer_name, ids,  # type: ignore[arg-type]
                                                           count=count, block=block))
        except redis.ResponseError as e:
            if not _no_group(e):
                raise
            # The stream or the group is gone (FLUSHALL, DEL, a Redis restarted without its data): recreate.
            self._create_groups(ids)
            return self._io(lambda: self.client.xreadgroup(GROUP, self.consumer_name, ids,  # type: ignore[arg-type]
                                                           count=count, block=None))

    def _take(self, resp: Any, remaining: dict[str, int]) -> list[Delivery]:
        out: list[Delivery] = []
        for name, entries in _streams(resp):
            s = _s(name)  # decoded once per stream per reply
            for entry_id, fields in entries:
                out.append(self._delivery(s, entry_id, _fields(fields)))
            remaining[s] -= len(entries)
        return out

    def _call(self, script: Any, keys: list[str], args: Sequence[str | int],
              streams: Iterable[str]) -> Any:
        self.round_trips += 1
        try:
            return self._io(lambda: script(keys=keys, args=args))
        except redis.ResponseError as e:
            if not _no_group(e):
                raise
            self._create_groups(streams)
            return self._io(lambda: script(keys=keys, args=args))

    # ---------------------------------------------------------------- recovery, cancellations

    def recover(self) -> tuple[list[Inbound], list[DeadLetter]]:
        """The Transport recovery: recover_streams, each entry decoded."""
        kept, dead = self.recover_streams()
        return [self.inbound(d) for d in kept], dead

    def recover_streams(self) -> tuple[list[Delivery], list[DeadLetter]]:
        """Recovery by ownership, in one script call for all streams (plus one call per stream where
        this consumer's own pending list holds entries the worker does not):

        * the pending entries of every other consumer name are claimed into this one (XCLAIM, min
          idle 0): the lease holder is the only live consumer of this worker id;
        * this consumer's own pending entries are never claimed by idle time; those the worker does
          not hold (handed out, not yet completed) are handed out again: a read whose reply was lost
          in a reconnect, or a fenced predecessor's read under the same consumer name. Streams
          whose start-up pending re-read (read()) is not finished are left to it.

        Entries delivered more than max_deliveries times (the claim counts) are dead-lettered (reason
        too_many_deliveries, original fields kept) and acked in the same script; the rest are
        returned as deliveries, in stream order per stream."""
        streams = list(self.streams)
        if not streams:
            return [], []
        st = self.settings
        args: list[str | int] = [GROUP, self.consumer_name, st.claim_count,
                                 st.max_deliveries, st.dlq_maxlen, MAX_DEAD_LETTER_FIELDS]
        reply = self._call(self._recover, [self.keys.dead_letters, *streams], args, streams)
        kept_out: list[Delivery] = []
        dead_out: list[DeadLetter] = []
        for s, (kept, dead, own) in zip(streams, reply, strict=True):
            held = self._outstanding.get(s, set())
            if s in self._drained and int(own) > len(held):
                kept_out += self._orphans(s, held)
            for entry_id, _n, flat in kept:
                d = self._delivery(s, entry_id, _pairs(flat))
                kept_out.append(d)
                if s not in self._drained:
                    self._recovered.setdefault(s, set()).add(d.entry_id)
            for entry_id, n, flat in dead:
                d = self._delivery(s, entry_id, _pairs(flat), held=False)
                dead_out.append(DeadLetter(d, Reason.TOO_MANY_DELIVERIES,
                                           f"delivered {_s(n)} times (max {st.max_deliveries})"))
        return kept_out, dead_out

    def _orphans(self, stream: str, held: set[str]) -> list[Delivery]:
        """Own pending entries of `stream` that the worker does not hold, handed out again."""
        count = self.settings.claim_count
        self.round_trips += 1
        pending: Any = self._io(lambda: self.client.xpending_range(stream, GROUP, "-", "+", count,
                                                                   consumername=self.consumer_name))
        ids: list[Any] = [_s(p["message_id"]) for p in pending if _s(p["message_id"]) not in held]
        if not ids:
            return []
        self.round_trips += 1
        claimed: Any = self._io(lambda: self.client.xclaim(stream, GROUP, self.consumer_name, 0, ids))
        out: list[Delivery] = []
        for entry in claimed:
            if entry and entry[0] is not None:
                out.append(self._delivery(stream, entry[0], _fields(entry[1])))
        if out:
            log.warning("own pending entries the worker did not hold: handed out again", extra={
                "worker": self.worker_id, "stream": stream, "entries": len(out)})
        return out

    def checks(self, job_ids: Sequence[str], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """(the job ids already answered: their result record exists, the session ids with a cancel
        marker), in one round trip. The worker asks this for the openings of sessions it does not
        hold, before admitting them: a session's cancel recorded while the worker was down or before
        its first job was read wins, and a re-pushed opening that was answered long ago (by an
        earlier process) does not open a ghost session."""
        if not job_ids and not session_ids:
            return set(), set()
        jobs, sids = list(job_ids), list(session_ids)

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for j in jobs:
                pipe.exists(self.keys.result_record(j))
            for sid in sids:
                pipe.exists(self.keys.cancel_marker(sid))
            return pipe.execute()

        self.round_trips += 1
        replies = self._io(ask)
        answered = {j for j, r in zip(jobs, replies[:len(jobs)], strict=True) if int(r)}
        cancelled = {sid for sid, r in zip(sids, replies[len(jobs):], strict=True) if int(r)}
        return answered, cancelled

    def close_sessions(self, closures: Sequence[tuple[str, str]]) -> int:
        """Mark (session id, kind) accounting hashes closed when they exist and are open (no hash is
        created). For closures no answer carried: a cancel with nothing queued, a cancel of a session
        this worker does not hold, an engine failure. Returns how many were closed."""
        if not closures:
            return 0
        keys = [self.keys.session_account(sid) for sid, _ in closures]
        kinds = [kind for _, kind in closures]
        self.round_trips += 1
        return int(self._io(lambda: self._close(keys=keys, args=kinds)))

    def cancellations(self) -> list[str]:
        """Session ids cancelled since the last call (one non-blocking XREAD of keys.cancellations).
        The first call reads from the beginning of the (MAXLEN-trimmed) stream."""
        self.round_trips += 1
        resp = self._io(lambda: self.client.xread({self.keys.cancellations: self._cancel_cursor},
                                                  count=self.settings.cancel_count))
        out: list[str] = []
        stream = self.keys.cancellations
        for _name, entries in _streams(resp):
            for entry_id, raw in entries:
                self._cancel_cursor = _s(entry_id)
                fields = _fields(raw)
                reason, detail = Reason.MALFORMED, ""
                try:
                    if self.signer is not None and not self.signer.verify(stream, fields):
                        reason, detail = Reason.BAD_SIGNATURE, "missing or wrong HMAC"
                    else:
                        out.append(cancel_from_fields(fields))
                        continue
                except WireError as e:
                    detail = str(e)
                # No consumer group on this stream: phase and digest mean nothing for this dead letter.
                d = Delivery(stream=stream, entry_id=self._cancel_cursor, fields=fields, digest="", phase="decode")
                self._rejected_cancels.append(DeadLetter(d, reason, f"cancellation: {detail}"))
        return out

    def drain_rejected_cancellations(self) -> list[DeadLetter]:
        """The cancellation entries the last cancellations() calls refused, to pass to complete()."""
        out, self._rejected_cancels = self._rejected_cancels, []
        return out

    # ---------------------------------------------------------------- completion

    def complete(self, answers: Sequence[Answer], dead_letters: Sequence[DeadLetter] = (),
                 call: FusedCallStats | None = None) -> list[bool]:
        """The Transport completion: every answer's Completion record, in ONE EVALSHA (complete_entries)."""
        return self.complete_entries([completion_of(a) for a in answers], dead_letters, call)

    def complete_entries(self, completions: Sequence[Completion], dead_letters: Sequence[DeadLetter] = (),
                         call: FusedCallStats | None = None) -> list[bool]:
        """Answer a batch in ONE EVALSHA (none when all three are empty). Returns, per completion,
        whether it was the first to finish (False: a replay, or the job id was already answered).

        Per completion: XACK; then SET the result record NX EX; if that succeeded (the job id was
        never answered), XADD the result to the session's result stream and count the accounting
        (when the account is known: session: prompt, generated and recomputed tokens, steps,
        engine_seconds, account, closed; billing account: the same sums; always: worker: steps,
        tokens, results:<status>, steps:<phase>, engine_seconds_share). With a lease held, the
        script checks it first: LeaseLost when another process holds it (nothing written).
        Per dead letter: XACK; if it returned 1, XADD it to the dead-letter stream (reason,
        detail, stream, entry_id, the original fields prefixed 'f:'). "XACK returned 1" holds for
        every item of one call naming the same entry (a malformed delivery may be answered with a
        rejection and a dead letter at once); recover()'s dead letters are already dead-lettered and
        acked, so passing them here again changes nothing.
        The fused call (fused_calls, calls:<phase>, sessions:<phase>, tokens:<phase>,
        batch_size:<n>, engine_seconds) is counted unless every completion given was a replay.
        """
        if not completions and not dead_letters and call is None:
            return []
        st = self.settings
        keys = _Keys()
        keys(self.keys.worker_account)
        keys(self.keys.accounts_index)
        keys(self.keys.dead_letters)
        keys(self.keys.lease)
        keys(self.keys.lease_epoch)
        args = _argv(COMPLETE_ARGV, group=GROUP, result_ttl_s=st.result_ttl_s, result_maxlen=st.result_maxlen,
                     dlq_maxlen=st.dlq_maxlen, n_completions=len(completions), n_dead_letters=len(dead_letters),
                     has_call=1 if call is not None else 0, reject_ttl_s=st.reject_ttl_s,
                     lease_token=self.lease_token or "", lease_epoch=self.lease_epoch, lease_ms=st.lease_ms,
                     act_ttl_s=ACTIVATION_TTL_S)
        for c in completions:
            r = c.result
            fields = result_to_fields(r)
            acct = r.accounting
            args += _argv(
                COMPLETION_ARGV, stream_k=keys(c.delivery.stream), entry_id=c.delivery.entry_id,
                record_k=keys(self.keys.result_record(r.job_id)),
                record_value=json.dumps(fields, separators=(",", ":")),
                results_k=keys(self.keys.results(r.session_id)),
                session_k=keys(self.keys.session_account(r.session_id)),
                account_k=keys(self.keys.billing_account(c.account_id)) if c.account_id else 0,
                account_id=c.account_id or "", status=r.status.value, phase=c.phase,
                prompt_tokens=acct.prompt_tokens, generated_tokens=acct.generated_tokens,
                engine_seconds=repr(float(acct.engine_seconds)), close=c.close or "", start=c.start,
                replay=1 if c.replay else 0, in_blob_k=self._own_blob(keys, c.in_blob),
                out_blob_k=self._out_blob(keys, c), out_blob=c.out_blob or b"", nf=len(fields),
            )
            for k, v in fields.items():
                args += [k, v]
        for d in dead_letters:
            flat = self._dead_letter_fields(d)
            sk = 0 if d.delivery.stream == self.keys.cancellations else keys(d.delivery.stream)
            args += _argv(DEAD_LETTER_ARGV, stream_k=sk, entry_id=d.delivery.entry_id, nf=len(flat) // 2)
            args += flat
        if call is not None:
            if not math.isfinite(call.engine_seconds) or call.engine_seconds < 0:
                raise ValueError(f"engine_seconds must be finite and >= 0, not {call.engine_seconds}")
            args += _argv(FUSED_CALL_ARGV, phase=call.phase, batch_size=int(call.batch_size),
                          tokens=int(call.tokens), engine_seconds=repr(float(call.engine_seconds)))
        self.round_trips += 1
        try:
            # Re-sent as is after a reconnect: the script is idempotent by job id.
            reply = self._io(lambda: self._complete(keys=keys.keys, args=args))
        except redis.ResponseError as e:
            if str(e).startswith("DGRFENCED"):
                raise LeaseLost(f"worker {self.worker_id}: {e}") from None
            raise
        for c in completions:
            self._outstanding.get(c.delivery.stream, set()).discard(c.delivery.entry_id)
        for d in dead_letters:
            self._outstanding.get(d.delivery.stream, set()).discard(d.delivery.entry_id)
        return [bool(int(x)) for x in reply]

    def _own_blob(self, keys: _Keys, blob: str | None) -> int:
        """KEYS index of an activations blob in this worker's tag, 0 for none. A key outside the tag
        (a job naming another worker's key) is never touched: the script stays in one Cluster slot."""
        if blob is None or not blob.startswith(self.keys.base + ":act:"):
            return 0
        return keys(blob)

    def _out_blob(self, keys: _Keys, c: Completion) -> int:
        hidden = c.result.hidden
        if c.out_blob is None or hidden is None or hidden.blob != self.keys.activations_out(c.result.job_id):
            if c.out_blob is not None:
                raise ValueError(f"output rows of {c.result.job_id} need result.hidden.blob = its activations_out key")
            return 0
        return keys(hidden.blob)

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        """The bytes of each input activations blob (None: missing, or not a key of this worker's
        activations), in ONE round trip (MGET: every key is in this worker's hash tag)."""
        own = [b for b in dict.fromkeys(blobs) if b.startswith(self.keys.base + ":act:in:")]
        if not own:
            return [None] * len(blobs)
        self.round_trips += 1
        got: Any = self._io(lambda: self.client.mget(own))
        by_key = dict(zip(own, got, strict=True))
        return [by_key.get(b) for b in blobs]

    def _dead_letter_fields(self, d: DeadLetter) -> list[str | bytes]:
        out: list[str | bytes] = [
            "reason", d.reason.value, "detail", d.detail[:_DETAIL_MAX], "stream", d.delivery.stream,
            "entry_id", d.delivery.entry_id, "consumer", self.consumer_name,
        ]
        room = MAX_DEAD_LETTER_BYTES
        cut = False
        for i, (k, v) in enumerate(d.delivery.fields.items()):
            if i >= MAX_DEAD_LETTER_FIELDS or room <= 0:
                cut = True
                break
            raw = _b(v)
            name, value = b"f:" + _b(k)[:256], raw[:min(MAX_FIELD_BYTES, room)]
            cut = cut or len(value) < len(raw) or len(name) < len(_b(k)) + 2
            room -= len(name) + len(value)
            out += [name, value]
        if cut:  # the copy is not the whole entry: never replay it as if it were
            out += ["truncated", "1"]
        return out

    # ---------------------------------------------------------------- observability, upkeep

    def input_lag(self) -> dict[str, dict[str, int]]:
        """Per registered stream: length, lag (XINFO GROUPS 'lag'; the length where Redis cannot
        tell), pending. One round trip."""
        if not self.streams:
            return {}

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for s in self.streams:
                pipe.xlen(s)
                pipe.xinfo_groups(s)
            return pipe.execute(raise_on_error=False)

        replies = self._io(ask)
        out: dict[str, dict[str, int]] = {}
        for i, s in enumerate(self.streams):
            sl = stream_lag(replies[2 * i], replies[2 * i + 1])
            pending = int(sl.group.get("pending") or 0) if sl.group is not None else 0
            out[s] = {"length": sl.length, "lag": sl.behind, "pending": pending}
        return out

    def trim(self) -> None:
        """Drop what no consumer needs any more, so hostile or merely old entries cannot pile up:
        input entries the group has delivered and acked (XTRIM MINID ~ below the oldest pending
        entry, or just past the last delivered one; only while `dgr-workers` is the stream's only
        group, since another group's reader would lose entries), and cancellations beyond
        cancel_maxlen (writers other than the producer may not trim). Two round trips."""
        if not self.streams:
            return

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for s in self.streams:
                pipe.xinfo_groups(s)
                pipe.xpending(s, GROUP)
            return pipe.execute(raise_on_error=False)

        replies = self._io(ask)

        def cut() -> None:
            pipe = self.client.pipeline(transaction=False)
            for i, s in enumerate(self.streams):
                upto = _trim_point(replies[2 * i], replies[2 * i + 1])
                if upto is not None:
                    pipe.xtrim(s, minid=upto, approximate=True)
            pipe.xtrim(self.keys.cancellations, maxlen=self.settings.cancel_maxlen, approximate=True)
            pipe.execute(raise_on_error=False)

        self._io(cut)  # a trim is idempotent: re-sent as is after a reconnect
        self.round_trips += 2

    def trim_results(self, session_id: str, maxlen: int = 0) -> int:
        """Trim one session's result stream to about `maxlen` entries (0: drop it). Returns the
        number of entries removed."""
        key = self.keys.results(session_id)
        if maxlen <= 0:
            n = int(self._io(lambda: self.client.xlen(key)))
            self._io(lambda: self.client.delete(key))
            return n
        return int(self._io(lambda: self.client.xtrim(key, maxlen=maxlen, approximate=True)))


def _trim_point(groups: Any, pending: Any) -> str | None:
    """The MINID below which every entry of an input stream is delivered and acked, or None."""
    if isinstance(groups, Exception) or isinstance(pending, Exception) or len(groups) != 1:
        return None
    g = groups[0]
    if _s(g.get("name", b"")) != GROUP:
        return None
    if int(pending.get("pending") or 0) > 0 and pending.get("min"):
        return _s(pending["min"])
    ms, _, seq = _s(g.get("last-delivered-id") or b"0-0").partition("-")
    return f"{ms}-{int(seq or 0) + 1}"
