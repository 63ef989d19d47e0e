"""The worker's Redis I/O: read step jobs, answer them, recover, dead-letter, count. No engine here.

The worker loop calls `RedisTransport` and knows no Redis command. One fused batch costs one read
(plus a bounded gather of non-blocking reads), one `complete()` (exactly one EVALSHA whatever the
batch size) and at most one `cancellations()` check.

Delivery is at least once: an entry stays in this consumer's pending list until `complete()` acks
it. Exactly-once *effects* come from the completion script: XACK says whether this delivery is the
first to finish, the result record `SET NX` says whether this job id was ever answered, and only then
are the result published and the counters moved. Replaying a completion, or completing a second
entry that carries an already answered job id, changes nothing.

Every key a script touches is passed in KEYS and all of them share the worker's hash tag, so the
scripts are Redis Cluster safe. Scripts live in `consumer/lua/*.lua`.

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
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

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
from schemas.limits import MAX_FIELD_BYTES
from schemas.wire import cancel_from_fields, result_to_fields

__all__ = [
    "Completion", "DeadLetter", "Delivery", "FusedCallStats", "RedisTransport", "TransportSettings",
    "load_lua",
]

MAX_DEAD_LETTER_FIELDS = 64  # original fields copied into a dead letter (a malformed entry may have many)
# Bytes of the original entry a dead letter written by complete() keeps, all fields together: more
# than any valid entry (4096 tokens + a SessionSpec), so a dead letter can still be replayed, yet a
# flood of huge malformed entries costs the dead-letter stream at most this much per entry.
MAX_DEAD_LETTER_BYTES = 2 * MAX_FIELD_BYTES
_DETAIL_MAX = 1024


def load_lua(name: str) -> str:
    """The text of `consumer/lua/<name>.lua`."""
    return (resources.files("consumer") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str  # input stream key (decoded str)
    entry_id: str
    fields: dict[bytes, bytes]
    digest: str  # from parse_input_stream(stream)
    phase: Phase


@dataclass(frozen=True, slots=True)
class Completion:
    """One answered step: ack + (first time only) store, publish, count."""

    delivery: Delivery
    result: StepResult  # its session_id names the result stream
    account_id: str | None  # billing account to charge (None: session unknown -> no account counters)
    phase: Phase
    close: Literal["finished", "cancelled"] | None = None  # marks the session's accounting closed


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


@dataclass(frozen=True)
class TransportSettings:
    """The client's socket_timeout (if set) must exceed block_ms, or a blocked read times out."""

    block_ms: int = 50  # idle blocking read (<= 0: never block)
    gather_ms: float = 2.0  # bounded gather window after a wake-up (<= 0: no gather)
    claim_idle_ms: int = 30_000  # XAUTOCLAIM min idle
    max_deliveries: int = 5  # past this, dead-letter
    result_ttl_s: int = 86_400  # TTL of stored results (SET NX EX) and of the result streams
    # TTL of what an answer to a session this worker does not hold leaves behind (its result record;
    # its result stream, unless that lives longer): long enough for a caller to read it.
    reject_ttl_s: int = 300
    result_maxlen: int = 10_000  # MAXLEN ~ of each result stream
    dlq_maxlen: int = 100_000
    cancel_maxlen: int = 100_000
    heartbeat_ttl_s: int = 10
    claim_count: int = 1_000  # entries XAUTOCLAIMed per stream per recover()
    cancel_count: int = 10_000  # cancellations read per check


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
    """The stream or its group is gone (fakeredis words a missing key differently)."""
    msg = str(e)
    return "NOGROUP" in msg or "requires the key to exist" in msg


def _pairs(flat: Sequence[bytes] | None) -> dict[bytes, bytes]:
    if not flat:
        return {}
    it = iter(flat)
    return {_b(k): _b(v) for k, v in zip(it, it, strict=False)}


def _fields(fields: Mapping[bytes, bytes] | None) -> dict[bytes, bytes]:
    if not fields:
        return {}
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
        self._cursor: dict[str, str] = {}  # stream -> last own pending id re-read
        self._drained: set[str] = set()
        self._recovered: dict[str, set[str]] = {}  # ids recover() handed out, while not drained
        self._cancel_cursor = "0-0"
        self.round_trips = 0  # requests sent to Redis (a pipeline or a script counts as one)
        # Entries read() dead-lettered on its pending re-read (already in the dead-letter stream and
        # acked): for logs and metrics; the newest 1000 are kept, clear it freely.
        self.dead_lettered: deque[DeadLetter] = deque(maxlen=1000)
        # Cancellation entries cancellations() could not take (undecodable, unsigned): the worker passes
        # them to complete() as dead letters (drain_rejected_cancellations).
        self._rejected_cancels: list[DeadLetter] = []
        self._complete = client.register_script(load_lua("complete"))
        self._pending = client.register_script(load_lua("deadletter") + load_lua("pending"))
        self._recover = client.register_script(load_lua("deadletter") + load_lua("recover"))

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
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.spec, json.dumps(spec, default=str, separators=(",", ":")))
        pipe.sadd(WORKERS_INDEX, self.worker_id)
        pipe.execute()
        for script in (self._complete, self._pending, self._recover):
            self.client.script_load(script.script)  # so the first complete() is one EVALSHA
        for s in streams:
            if s not in self.streams:
                self.streams.append(s)
        return streams

    def heartbeat(self, info: Mapping[str, object] | None = None) -> None:
        """SET keys.heartbeat to {ts, worker_id, consumer, **info} (JSON), EX heartbeat_ttl_s."""
        body = {"ts": time.time(), "worker_id": self.worker_id, "consumer": self.consumer_name,
                **(info or {})}
        self.client.set(self.keys.heartbeat, json.dumps(body, default=str, separators=(",", ":")),
                        ex=self.settings.heartbeat_ttl_s)

    def _create_groups(self, streams: Iterable[str]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for s in streams:
            pipe.xgroup_create(s, GROUP, id="0", mkstream=True)
        for r in pipe.execute(raise_on_error=False):
            if isinstance(r, Exception) and "BUSYGROUP" not in str(r):
                raise r

    def _stream_meta(self, stream: str) -> tuple[str, Phase]:
        m = self._meta.get(stream)
        if m is None:
            parsed = parse_input_stream(stream)
            if parsed is None or parsed[0] != self.worker_id:
                raise ValueError(f"{stream!r} is not an input stream of worker {self.worker_id!r}")
            m = self._meta[stream] = (parsed[1], parsed[2])
        return m

    def _delivery(self, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes]) -> Delivery:
        digest, phase = self._meta[stream]
        return Delivery(stream=stream, entry_id=_s(entry_id), fields=fields, digest=digest, phase=phase)

    # ---------------------------------------------------------------- reading

    def read(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
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
                d = self._delivery(s, entry_id, _pairs(flat))
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
        pipe = self.client.pipeline(transaction=False)
        for count, ids in by_count.items():
            pipe.xreadgroup(GROUP, self.consumer_name, ids, count=count)  # type: ignore[arg-type]
        out: list[Delivery] = []
        lost_group = False
        for resp in pipe.execute(raise_on_error=False):  # the replies that worked count, entries were taken
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
            return self.client.xreadgroup(GROUP, self.consumer_name, ids, count=count,  # type: ignore[arg-type]
                                          block=block)
        except redis.ResponseError as e:
            if not _no_group(e):
                raise
            self._create_groups(ids)  # the stream was deleted under us (FLUSHALL, DEL): recreate
            return self.client.xreadgroup(GROUP, self.consumer_name, ids, count=count,  # type: ignore[arg-type]
                                          block=None)

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
            return script(keys=keys, args=args)
        except redis.ResponseError as e:
            if not _no_group(e):
                raise
            self._create_groups(streams)
            return script(keys=keys, args=args)

    # ---------------------------------------------------------------- recovery, cancellations

    def recover(self) -> tuple[list[Delivery], list[DeadLetter]]:
        """XAUTOCLAIM entries idle > claim_idle_ms on every registered stream into this consumer, in
        one script call for all streams. Entries delivered more than max_deliveries times (the claim
        counts) are dead-lettered (reason too_many_deliveries, original fields kept) and acked in
        the same script; the rest are returned as deliveries.

        An entry this very consumer holds for longer than claim_idle_ms is claimed (and returned)
        again too: keep steps far shorter than claim_idle_ms."""
        streams = list(self.streams)
        if not streams:
            return [], []
        st = self.settings
        args: list[str | int] = [GROUP, self.consumer_name, st.claim_idle_ms, st.claim_count,
                                 st.max_deliveries, st.dlq_maxlen, MAX_DEAD_LETTER_FIELDS]
        reply = self._call(self._recover, [self.keys.dead_letters, *streams], args, streams)
        kept_out: list[Delivery] = []
        dead_out: list[DeadLetter] = []
        for s, (kept, dead) in zip(streams, reply, strict=True):
            for entry_id, _n, flat in kept:
                d = self._delivery(s, entry_id, _pairs(flat))
                kept_out.append(d)
                if s not in self._drained:
                    self._recovered.setdefault(s, set()).add(d.entry_id)
            for entry_id, n, flat in dead:
                d = self._delivery(s, entry_id, _pairs(flat))
                dead_out.append(DeadLetter(d, Reason.TOO_MANY_DELIVERIES,
                                           f"delivered {_s(n)} times (max {st.max_deliveries})"))
        return kept_out, dead_out

    def cancellations(self) -> list[str]:
        """Session ids cancelled since the last call (one non-blocking XREAD of keys.cancellations).
        The first call reads from the beginning of the (MAXLEN-trimmed) stream."""
        self.round_trips += 1
        resp = self.client.xread({self.keys.cancellations: self._cancel_cursor},
                                 count=self.settings.cancel_count)
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

    def complete(self, completions: Sequence[Completion], dead_letters: Sequence[DeadLetter] = (),
                 call: FusedCallStats | None = None) -> list[bool]:
        """Answer a batch in ONE EVALSHA (none when all three are empty). Returns, per completion,
        whether it was the first to finish (False: a replay, or the job id was already answered).

        Per completion: XACK; if it returned 1, SET the result record NX EX; if that succeeded,
        XADD the result to the session's result stream and count the accounting (session: prompt
        and generated tokens, steps, engine_seconds, account, closed; billing account: the same
        sums; worker: steps, tokens, results:<status>, steps:<phase>, engine_seconds_share).
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
        args: list[str | int | bytes] = [GROUP, st.result_ttl_s, st.result_maxlen, st.dlq_maxlen,
                                         len(completions), len(dead_letters), 1 if call is not None else 0,
                                         st.reject_ttl_s]
        for c in completions:
            r = c.result
            fields = result_to_fields(r)
            acct = r.accounting
            args += [
                keys(c.delivery.stream), c.delivery.entry_id,
                keys(self.keys.result_record(r.job_id)), json.dumps(fields, separators=(",", ":")),
                keys(self.keys.results(r.session_id)), keys(self.keys.session_account(r.session_id)),
                keys(self.keys.billing_account(c.account_id)) if c.account_id else 0, c.account_id or "",
                r.status.value, c.phase, acct.prompt_tokens, acct.generated_tokens,
                repr(float(acct.engine_seconds)), c.close or "", len(fields),
            ]
            for k, v in fields.items():
                args += [k, v]
        for d in dead_letters:
            flat = self._dead_letter_fields(d)
            sk = 0 if d.delivery.stream == self.keys.cancellations else keys(d.delivery.stream)
            args += [sk, d.delivery.entry_id, len(flat) // 2, *flat]
        if call is not None:
            if not math.isfinite(call.engine_seconds) or call.engine_seconds < 0:
                raise ValueError(f"engine_seconds must be finite and >= 0, not {call.engine_seconds}")
            args += [call.phase, int(call.batch_size), int(call.tokens), repr(float(call.engine_seconds))]
        self.round_trips += 1
        reply = self._complete(keys=keys.keys, args=args)
        return [bool(int(x)) for x in reply]

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
        pipe = self.client.pipeline(transaction=False)
        for s in self.streams:
            pipe.xlen(s)
            pipe.xinfo_groups(s)
        replies = pipe.execute(raise_on_error=False)
        out: dict[str, dict[str, int]] = {}
        for i, s in enumerate(self.streams):
            length, groups = replies[2 * i], replies[2 * i + 1]
            length = 0 if isinstance(length, Exception) else int(length)
            lag, pending = length, 0
            if not isinstance(groups, Exception):
                for g in groups:
                    if _s(g.get("name", b"")) == GROUP:
                        pending = int(g.get("pending") or 0)
                        if g.get("lag") is not None:
                            lag = int(g["lag"])
            out[s] = {"length": length, "lag": lag, "pending": pending}
        return out

    def trim(self) -> None:
        """Drop what no consumer needs any more, so hostile or merely old entries cannot pile up:
        input entries the group has delivered and acked (XTRIM MINID ~ below the oldest pending
        entry, or just past the last delivered one; only while `dgr-workers` is the stream's only
        group, since another group's reader would lose entries), and cancellations beyond
        cancel_maxlen (writers other than the producer may not trim). Two round trips."""
        if not self.streams:
            return
        pipe = self.client.pipeline(transaction=False)
        for s in self.streams:
            pipe.xinfo_groups(s)
            pipe.xpending(s, GROUP)
        replies = pipe.execute(raise_on_error=False)
        pipe = self.client.pipeline(transaction=False)
        for i, s in enumerate(self.streams):
            upto = _trim_point(replies[2 * i], replies[2 * i + 1])
            if upto is not None:
                pipe.xtrim(s, minid=upto, approximate=True)
        pipe.xtrim(self.keys.cancellations, maxlen=self.settings.cancel_maxlen, approximate=True)
        self.round_trips += 2
        pipe.execute(raise_on_error=False)

    def trim_results(self, session_id: str, maxlen: int = 0) -> int:
        """Trim one session's result stream to about `maxlen` entries (0: drop it). Returns the
        number of entries removed."""
        key = self.keys.results(session_id)
        if maxlen <= 0:
            n = int(self.client.xlen(key))
            self.client.delete(key)
            return n
        return int(self.client.xtrim(key, maxlen=maxlen, approximate=True))


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
