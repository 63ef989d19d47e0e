"""The producer's sans-I/O core: every decision of the Tracker side, no Redis call, no sleep.

Both drivers (`producer.client.Producer`, synchronous, and `producer.aio.AsyncProducer`, on asyncio)
are thin loops over this module: they ask Redis what the core needs to know (a worker's
advertisement, a stream's lag, a cancel marker, result entries) and send the commands the core
queued into a `Batch` (stream writes, the session record). The core never does I/O, so it is tested
on its own (tests/test_producer_core.py) and the two drivers cannot drift apart: a session's state
machine (results -> next pushes), the replay after `state_lost`, what is re-pushed after an outage,
how a handle is rebuilt by `resume`, all live here, once.

Clocks are read here (`time.time()` for `created_at`, `time.monotonic()` for cache ages) because they
are values, not I/O; what to wait for, and how, is the driver's business.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas import (
    CompatibilityKey,
    Phase,
    Reason,
    SessionSpec,
    Signer,
    Status,
    StepJob,
    StepResult,
    WireError,
    WorkerKeys,
    cancel_to_fields,
    job_to_fields,
    results_from_fields,
)
from schemas.lag import stream_lag
from schemas.limits import (
    CANCEL_MARKER_TTL_S,
    CANCEL_MAXLEN,
    MAX_CONTINUATION,
    MAX_POSITION,
    MAX_TOKENS_PER_JOB,
    SESSION_RECORD_TTL_S,
)

from . import credit
from .validate import check_id, check_token, check_tokens, vocab_size

__all__ = [
    "CANCEL_MAXLEN", "READ_COUNT", "Backpressure", "Batch", "CoreSettings", "ProducerCore", "ResultTimeout", "Resumer",
    "SessionFailed", "SessionHandle", "WorkerInfo", "decode_str", "job_id", "read_streams",
]

READ_COUNT = 1_000  # results read per stream per XREAD (and per XRANGE page of resume)
# Tokens per decode job by default (a continuation job: producer/credit.py), so a session never waits on
# the Tracker between tokens. 1 keeps one job per token (the behaviour before continuation jobs). The
# producer asks for n > 1 only from a worker that advertises max_continuation, and never on a route of
# several hops.
DECODE_N = 16
BackpressurePolicy = Literal["raise", "wait"]


class Backpressure(RuntimeError):
    """The target worker's input lag is over the bound."""


class ResultTimeout(TimeoutError):
    """No result arrived within timeout_s."""


class SessionFailed(RuntimeError):
    """A session ended with rejected / failed / an unrecoverable state_lost (generate() raises it)."""

    def __init__(self, handle: SessionHandle) -> None:
        super().__init__(f"session {handle.session_id} ended with {handle.status}"
                         + (f" ({handle.reason}: {handle.detail})" if handle.reason else ""))
        self.handle = handle


def job_id(session_id: str, hop: int, phase: Phase, position: int, attempt: int) -> str:
    """Deterministic job id: 40 hex chars of sha1 over (session, hop, phase, position, attempt)."""
    check_id(session_id, "session_id")
    raw = f"{session_id}\x1f{hop}\x1f{phase}\x1f{position}\x1f{attempt}".encode()
    return hashlib.sha1(raw, usedforsecurity=False).hexdigest()


def decode_str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def read_streams(resp: Any) -> Iterator[tuple[bytes | str, list[tuple[Any, Any]]]]:
    """(stream name, entries) of an XREAD reply, RESP2 (a list) or RESP3 (a dict)."""
    if not resp:
        return
    if isinstance(resp, dict):  # RESP3
        for name, value in resp.items():
            yield name, (value[0] if value and isinstance(value[0], list) else value)
    else:
        for name, entries in resp:
            yield name, entries


@dataclass
class WorkerInfo:
    worker_id: str
    keys: list[CompatibilityKey]
    info: dict[str, Any]
    alive: bool  # the heartbeat key exists (it expires ~10 s after the last beat)
    heartbeat_age_s: float | None
    heartbeat: dict[str, Any] = field(default_factory=dict)

    @property
    def digests(self) -> set[str]:
        return {k.digest for k in self.keys}

    @staticmethod
    def parse(worker_id: str, spec_raw: bytes | str | None, hb_raw: bytes | str | None) -> WorkerInfo | None:
        """From the worker's `spec` and heartbeat keys; None when it never advertised."""
        if spec_raw is None:
            return None
        spec = json.loads(spec_raw)
        keys = [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec.get("keys", [])]
        hb = json.loads(hb_raw) if hb_raw is not None else {}
        age = max(0.0, time.time() - float(hb["ts"])) if "ts" in hb else None
        return WorkerInfo(worker_id=worker_id, keys=keys, info=dict(spec.get("info", {})),
                          alive=hb_raw is not None, heartbeat_age_s=age, heartbeat=hb)


@dataclass
class SessionHandle:
    """One session as the producer drives it. `status`: "open" while it runs, "finished" when a
    result said finished, else the Status that ended it ("rejected", "failed", "cancelled"), or
    "state_lost" (not finished: call `Producer.replay`)."""

    spec: SessionSpec
    prompt: tuple[int, ...]
    worker_id: str
    position: int = 0  # the next position to push
    generated: list[int] = field(default_factory=list)
    attempt: int = 0
    finished: bool = False
    status: str = "open"
    last_result_id: str = "0-0"
    pending_job: str | None = None  # the sampling job whose result (a token) is awaited
    hop: int = 0
    reason: str | None = None
    detail: str = ""
    jobs: set[str] = field(default_factory=set)  # unanswered job ids of the current attempt
    last_result: StepResult | None = None
    opened_at: float = 0.0
    replayed_generated: int = 0  # generated tokens re-fed by the current attempt's prefill (0: attempt 0)
    credit: credit.Credit = field(default_factory=credit.Credit)  # continuation jobs (producer/credit.py)

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def results_key(self) -> str:
        return WorkerKeys(self.worker_id).results(self.spec.session_id)

    def input_stream(self, phase: Phase) -> str:
        key = self.spec.route[self.hop].key.for_phase(phase)
        return WorkerKeys(self.worker_id).input_stream(key.digest, phase)

    @property
    def awaits_replay(self) -> bool:
        """Its state was lost and it is not finished: the next step is a replay (or a cancel)."""
        return self.status == "state_lost" and not self.finished


class Batch:
    """Redis commands the core queued, as (method name, args, kwargs) of a redis-py pipeline. A driver
    sends them as one pipeline, and again as a whole after an outage (every command is idempotent:
    pushes carry job ids the worker answers once, the record is a plain overwrite)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __bool__(self) -> bool:
        return bool(self.ops)

    def xadd(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("xadd", args, kwargs))

    def hset(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("hset", args, kwargs))

    def expire(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("expire", args, kwargs))

    def set(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("set", args, kwargs))

    def apply_to(self, pipe: Any) -> Any:
        """Queue the commands on a redis-py pipeline (sync or asyncio: both queue synchronously)."""
        for name, args, kwargs in self.ops:
            getattr(pipe, name)(*args, **kwargs)
        return pipe


class ProducerCore:
    """The producer's settings and every decision it makes. Methods named `queue_*` append commands to a
    Batch and update the handle as if they were sent (the drivers send them before anything else can
    look at the handle); nothing here touches Redis."""

    def __init__(self, *, prefill_chunk: int = 512, max_lag: int | None = 10_000,
                 backpressure: BackpressurePolicy = "raise", timeout_s: float = 60.0, max_attempts: int = 3,
                 verify_route: bool = True, lag_cache_s: float = 0.1, discover_cache_s: float = 1.0,
                 signer: Signer | None = None, cancel_ttl_s: int = CANCEL_MARKER_TTL_S,
                 record_ttl_s: int = SESSION_RECORD_TTL_S, decode_n: int = DECODE_N) -> None:
        if not 1 <= prefill_chunk <= MAX_TOKENS_PER_JOB:
            raise ValueError(f"prefill_chunk must be in [1, {MAX_TOKENS_PER_JOB}]")
        if backpressure not in ("raise", "wait"):
            raise ValueError("backpressure must be 'raise' or 'wait'")
        self.prefill_chunk = prefill_chunk
        self.max_lag = max_lag
        self.backpressure: BackpressurePolicy = backpressure
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.verify_route = verify_route
        self.lag_cache_s = lag_cache_s
        self.discover_cache_s = discover_cache_s
        self.signer = signer
        self.cancel_ttl_s = cancel_ttl_s
        self.record_ttl_s = record_ttl_s
        if isinstance(decode_n, bool) or not isinstance(decode_n, int) or not 1 <= decode_n <= MAX_CONTINUATION:
            raise ValueError(f"decode_n must be an int in [1, {MAX_CONTINUATION}]")
        self.decode_n = decode_n  # tokens per decode job (producer/credit.py; 1: one job per token)
        self.lag: dict[str, tuple[float, int]] = {}  # stream -> (monotonic time asked, lag)
        self.discovered: dict[str, tuple[float, WorkerInfo]] = {}

    # ---------------------------------------------------------------- discovery and validation

    def remember(self, info: WorkerInfo) -> None:
        self.discovered[info.worker_id] = (time.monotonic(), info)

    def route_worker_to_discover(self, spec: SessionSpec, hop: int) -> str | None:
        """The hop's worker when its advertisement must be (re)read before opening, else None."""
        if not self.verify_route:
            return None
        worker = spec.route[hop].worker_id
        cached = self.discovered.get(worker)
        if cached is None or time.monotonic() - cached[0] > self.discover_cache_s:
            return worker
        return None

    def vocab(self, worker_id: str) -> int | None:
        """The vocabulary the worker advertised, when this producer has discovered it."""
        cached = self.discovered.get(worker_id)
        return vocab_size(cached[1].info) if cached is not None else None

    def validate(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> tuple[int, ...]:
        """The prompt as plain ints, or TypeError/ValueError saying what is wrong. With verify_route,
        the hop's worker must have been discovered (`route_worker_to_discover`) first."""
        toks = self.check_shape(spec, prompt, hop)
        key = spec.route[hop].key
        worker = spec.route[hop].worker_id
        if self.verify_route:
            info = self.discovered[worker][1]
            for phase in ("prefill", "decode"):
                d = key.for_phase(phase).digest
                if d not in info.digests:
                    raise ValueError(f"worker {worker!r} does not advertise the route's {phase} key {d}")
        return check_tokens(toks, self.vocab(worker))

    def check_shape(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> tuple[int, ...]:
        """What can be checked without the worker's advertisement: types, hop, prompt, context."""
        if not isinstance(spec, SessionSpec):
            raise TypeError(f"spec must be a SessionSpec, not {type(spec).__name__}")
        if isinstance(hop, bool) or not isinstance(hop, int) or not 0 <= hop < len(spec.route):
            raise ValueError(f"hop {hop!r} is not on the route ({len(spec.route)} hops)")
        toks = check_tokens(prompt, None)
        if not toks:
            raise ValueError("empty prompt")
        key = spec.route[hop].key
        if key.boundary.consumes != "tokens":
            raise ValueError("this producer drives token-consuming hops only")
        ctx = key.recipe.ctx_per_session
        if len(toks) + spec.max_tokens > ctx:
            raise ValueError(f"prompt ({len(toks)}) + max_tokens ({spec.max_tokens}) over the context "
                             f"per session ({ctx})")
        if len(toks) + spec.max_tokens > MAX_POSITION:
            raise ValueError("session longer than MAX_POSITION")
        return toks

    def new_handle(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> SessionHandle:
        if len(spec.route) > 1:  # its hop 0 answers rows, not tokens: producer/route.py drives it
            raise ValueError("a route of several hops is driven by run_many / generate (docs/routes.md), "
                             "not step by step")
        toks = self.validate(spec, prompt, hop)
        return SessionHandle(spec=spec, prompt=toks, worker_id=spec.route[hop].worker_id, hop=hop,
                             opened_at=time.time())

    def check_decode_token(self, h: object, token: object) -> int:
        if not isinstance(h, SessionHandle):
            raise TypeError(f"h must be a SessionHandle, not {type(h).__name__}")
        return check_token(token, self.vocab(h.worker_id))

    @staticmethod
    def check_handles(handles: Iterable[object]) -> None:
        for h in handles:
            if not isinstance(h, SessionHandle):
                raise TypeError(f"handles must be SessionHandles, not {type(h).__name__}")

    # ---------------------------------------------------------------- backpressure

    def cached_lag(self, stream: str) -> int | None:
        """The stream's lag when it was asked less than lag_cache_s ago, else None (ask Redis)."""
        cached = self.lag.get(stream)
        if cached is not None and time.monotonic() - cached[0] < self.lag_cache_s:
            return cached[1]
        return None

    def record_lag(self, stream: str, length: object, groups: object) -> int:
        """The lag from an XLEN and an XINFO GROUPS reply (either may be an error: no stream yet)."""
        lag = stream_lag(length, groups).behind
        self.lag[stream] = (time.monotonic(), lag)
        return lag

    def within_lag(self, lag: int) -> bool:
        return self.max_lag is None or lag <= self.max_lag

    def over_lag(self, stream: str, waited_s: float | None = None) -> Backpressure:
        """The error to raise: at once ("raise"), or after waiting `waited_s` ("wait")."""
        if waited_s is None:
            return Backpressure(f"{stream}: input lag over {self.max_lag}")
        return Backpressure(f"{stream}: input lag over {self.max_lag} for {waited_s} s")

    # ---------------------------------------------------------------- signing

    def entry(self, stream: str, fields: dict[str, str]) -> dict[str, str]:
        return self.signer.signed(stream, fields) if self.signer is not None else fields

    # ---------------------------------------------------------------- jobs

    def prefill_jobs(self, h: SessionHandle) -> list[StepJob]:
        """The current attempt's prefill chunks: prompt + the generated tokens it re-feeds."""
        tokens = h.prompt + tuple(h.generated[:h.replayed_generated])
        # prompt_len tells the worker where the prompt ends: a replay's generated tokens are then computed
        # one row per call, as when they were decoded, so the replay is exact (docs/invariance.md).
        spec = SessionSpec.model_validate({**h.spec.model_dump(), "prompt_len": len(h.prompt),
                                           "max_tokens": h.spec.max_tokens - h.replayed_generated})
        compat = h.spec.route[h.hop].key.for_phase("prefill").digest
        now = time.time()
        n = self.prefill_chunk
        jobs = []
        for start in range(0, len(tokens), n):
            chunk = tokens[start:start + n]
            last = start + n >= len(tokens)
            jid = job_id(h.session_id, h.hop, "prefill", start, h.attempt)
            jobs.append(StepJob(job_id=jid, session_id=h.session_id, hop=h.hop, phase="prefill", compat=compat,
                                start_position=start, tokens=chunk, sample=last, attempt=h.attempt,
                                created_at=now, session=spec if start == 0 else None))
        return jobs

    def decode_job(self, h: SessionHandle, position: int, token: int) -> StepJob:
        key = h.spec.route[h.hop].key.for_phase("decode")
        jid = job_id(h.session_id, h.hop, "decode", position, h.attempt)
        return StepJob(job_id=jid, session_id=h.session_id, hop=h.hop, phase="decode", compat=key.digest,
                       start_position=position, tokens=(token,), sample=True, attempt=h.attempt,
                       created_at=time.time())

    def _push(self, batch: Batch, h: SessionHandle, job: StepJob) -> None:
        stream = h.input_stream(job.phase)
        batch.xadd(stream, self.entry(stream, job_to_fields(job)))

    def queue_prefill(self, batch: Batch, h: SessionHandle) -> None:
        """Push prompt + generated as prefill chunks of the handle's attempt (position 0 on), and the
        session's record (what `resume()` rebuilds a handle from)."""
        h.replayed_generated = len(h.generated)
        jobs = self.prefill_jobs(h)
        h.jobs = set()
        h.credit.clear()
        if not h.credit.n:
            h.credit.n = credit.tokens_per_job(self, h)
        for job in jobs:
            self._push(batch, h, job)
            h.jobs.add(job.job_id)
        h.pending_job = jobs[-1].job_id
        h.position = jobs[-1].end_position
        h.status = "open"
        h.reason, h.detail = None, ""
        record = WorkerKeys(h.worker_id).session_record(h.session_id)
        batch.hset(record, mapping={"spec": h.spec.model_dump_json(), "prompt": ",".join(map(str, h.prompt)),
                                    "hop": str(h.hop), "attempt": str(h.attempt), "decode_n": str(h.credit.n)})
        batch.expire(record, self.record_ttl_s)

    def queue_unanswered(self, batch: Batch, h: SessionHandle) -> int:
        """Re-push the handle's unanswered jobs of its current attempt (idempotent: same job ids).
        Returns how many."""
        if h.finished or h.status == "state_lost" or not h.jobs:
            return 0
        n = 0
        for job in self.prefill_jobs(h):
            if job.job_id in h.jobs:
                self._push(batch, h, job)
                n += 1
        if h.pending_job in h.jobs and h.generated and h.position > 0:
            job = self.decode_job(h, h.position - 1, h.generated[-1])
            if job.job_id == h.pending_job:
                self._push(batch, h, job)
                n += 1
        return n + credit.requeue(self, batch, h)

    def queue_decode(self, batch: Batch, h: SessionHandle, token: int) -> str:
        _one_hop(h)
        if h.finished:
            raise ValueError(f"session {h.session_id} is {h.status}")
        job = self.decode_job(h, h.position, token)
        self._push(batch, h, job)
        h.jobs.add(job.job_id)
        h.pending_job = job.job_id
        h.position += 1
        return job.job_id

    def queue_replay(self, batch: Batch, h: SessionHandle, *, cancel_marked: bool) -> None:
        """After state_lost: attempt + 1 and the prefill of prompt + generated. `cancel_marked`: the
        session's cancel marker is set (the driver asked Redis): then nothing is pushed, it ends
        cancelled. SessionFailed when max_attempts is spent."""
        _one_hop(h)
        if cancel_marked:
            h.finished, h.status, h.jobs, h.pending_job = True, "cancelled", set(), None
            h.reason, h.detail = Reason.CANCELLED.value, "cancelled before the replay"
            return
        if h.attempt + 1 > self.max_attempts:
            h.finished = True
            raise SessionFailed(h)
        if len(h.generated) >= h.spec.max_tokens:
            h.finished, h.status, h.jobs, h.pending_job = True, "finished", set(), None
            return
        h.attempt += 1
        h.finished = False
        self.queue_prefill(batch, h)

    def cancel_ops(self, batch: Batch, worker_id: str, session_id: str) -> None:
        """The cancel: the marker (wins over a step not yet admitted) and the event, to send in one
        transaction. Both ids are checked here, before a key is built from them."""
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        sid = check_id(session_id, "session_id")
        batch.set(keys.cancel_marker(sid), "1", ex=self.cancel_ttl_s)
        batch.xadd(keys.cancellations, self.entry(keys.cancellations, cancel_to_fields(sid)),
                   maxlen=CANCEL_MAXLEN, approximate=True)

    # ---------------------------------------------------------------- the per-session state machine

    @staticmethod
    def apply(h: SessionHandle, r: StepResult) -> bool:
        """Apply one result to its handle. False (ignored) when it is not one of the handle's current
        jobs: an older attempt's, a stray job's, another session's."""
        if r.job_id not in h.jobs or r.session_id != h.session_id:
            return False
        h.jobs.discard(r.job_id)
        h.last_result = r
        if r.status == Status.OK:
            finished = r.finished
            if r.job_id == h.pending_job:
                h.pending_job = None
                if r.token is not None:
                    h.generated.append(r.token)
            elif credit.on_ok(h, r):  # a continuation job's token: in position order
                finished = credit.place(h, r)
            if finished:
                h.finished, h.status = True, "finished"
                h.jobs = set()  # credit left unused is dropped: what is answered for it is ignored
                h.credit.clear()
        else:
            h.reason, h.detail = (r.reason.value if r.reason else None), r.detail
            h.jobs, h.pending_job = set(), None
            h.credit.clear()
            if r.status == Status.STATE_LOST or (r.status == Status.REJECTED
                                                 and r.reason == Reason.UNKNOWN_SESSION):
                h.status = "state_lost"
            else:
                h.finished, h.status = True, r.status.value
        return True

    def apply_entries(self, h: SessionHandle, entries: Iterable[tuple[Any, Any]]) -> list[StepResult]:
        """Apply a stream's entries (read on from h.last_result_id) in order; the results applied."""
        return [r for r in read_on(h, entries) if self.apply(h, r)]

    def apply_read(self, by_key: Mapping[str, SessionHandle], resps: Iterable[Any]) -> dict[str, list[StepResult]]:
        """Apply XREAD replies over the handles' result streams (by stream key); results by session."""
        out: dict[str, list[StepResult]] = {}
        for resp in resps:
            for name, entries in read_streams(resp):
                h = by_key[decode_str(name)]
                applied = self.apply_entries(h, entries)
                if applied:
                    out.setdefault(h.session_id, []).extend(applied)
        return out

    def advance(self, batch: Batch, h: SessionHandle, replay_state_lost: bool, *, cancel_marked: bool = False) -> bool:
        """Queue the session's next job, if any: the next decode step after a token, or the replay after
        state_lost (`cancel_marked`: what Redis said of its cancel marker, asked by the driver when
        `needs_cancel_check`). True when something was queued."""
        if h.finished:
            return False
        if h.status == "state_lost":
            if not replay_state_lost:
                h.finished = True
                return False
            try:
                self.queue_replay(batch, h, cancel_marked=cancel_marked)
            except SessionFailed:
                return False
            return bool(h.jobs)
        return self.queue_next(batch, h)

    def queue_next(self, batch: Batch, h: SessionHandle) -> bool:
        """The session's next decode job, when one is due: under credit (producer/credit.py) or, with
        decode_n = 1, one job per token once the last one is answered. True when one was queued."""
        if h.credit.n > 1 and h.generated:
            return credit.queue_next(self, batch, h, h.credit.n)
        if h.pending_job is None and not h.jobs:
            if not h.generated:  # an ok sampling result without a token: nothing to feed
                h.finished, h.status, h.detail = True, "failed", "sampling result carried no token"
                return False
            self.queue_decode(batch, h, h.generated[-1])
            return True
        return False

    @staticmethod
    def needs_cancel_check(h: SessionHandle, replay_state_lost: bool) -> bool:
        """advance() would replay it: the driver must first ask whether its cancel marker is set."""
        return replay_state_lost and h.awaits_replay

    def after_outage(self, batch: Batch, live: Sequence[SessionHandle]) -> int:
        """Redis answered again: re-push every live session's unanswered jobs (idempotent). The driver
        then advances each (the next step of sessions whose last result was read but not acted on).
        Returns how many jobs were queued again."""
        return sum(self.queue_unanswered(batch, h) for h in live)

    @staticmethod
    def by_worker(handles: Iterable[SessionHandle]) -> dict[str, dict[str, SessionHandle]]:
        """The handles by worker, then by result stream key: one XREAD per worker (its keys share one
        hash tag, so the read is Redis Cluster safe)."""
        out: dict[str, dict[str, SessionHandle]] = {}
        for h in handles:
            out.setdefault(h.worker_id, {})[h.results_key] = h
        return out

    # ---------------------------------------------------------------- resuming

    def resumer(self, worker_id: str, session_id: str, record: Mapping[bytes | str, bytes | str]) -> Resumer:
        return Resumer(self, worker_id, session_id, {decode_str(k): decode_str(v) for k, v in record.items()})


class Resumer:
    """Rebuilds a handle from the session's record and its result stream, page by page, through the same
    state machine the drivers run: `cursor` is the XRANGE start of the next page (None: done), `feed()`
    takes a page, `finish()` returns the handle and the commands that re-push what is unanswered."""

    def __init__(self, core: ProducerCore, worker_id: str, session_id: str, record: dict[str, str]) -> None:
        if "spec" not in record:
            raise LookupError(f"no record of session {session_id!r} on worker {worker_id!r}")
        self.core = core
        spec = SessionSpec.model_validate_json(record["spec"])
        self.h = SessionHandle(spec=spec, prompt=tuple(int(t) for t in record["prompt"].split(",")),
                               worker_id=worker_id, hop=int(record.get("hop", "0")), opened_at=time.time())
        self.attempts = int(record.get("attempt", "0"))
        self.h.credit.n = max(1, int(record.get("decode_n", "1")))  # what the original driver used
        self.sink = Batch()  # the pushes the original driver made: rebuilt, not sent
        core.queue_prefill(self.sink, self.h)
        self.opening = job_id(self.h.session_id, self.h.hop, "prefill", 0, 0)
        self.first: str | None = None
        self.cursor: str | None = "-"

    def feed(self, page: Sequence[tuple[Any, Any]]) -> None:
        h = self.h
        for r in read_on(h, page):
            self.first = self.first or r.job_id
            if self.core.apply(h, r) and not h.finished:
                if h.status == "state_lost":
                    if h.attempt < self.attempts:  # the driver replayed it: follow
                        self.core.queue_replay(self.sink, h, cancel_marked=False)
                elif h.generated:
                    self.core.queue_next(self.sink, h)
        self.cursor = None if len(page) < READ_COUNT else "(" + h.last_result_id

    def finish(self) -> tuple[SessionHandle, Batch]:
        h = self.h
        if self.first is not None and self.first != self.opening:
            raise LookupError(f"the result stream of session {h.session_id!r} no longer starts at its opening")
        if h.status == "state_lost" and h.attempt < self.attempts:
            self.core.queue_replay(self.sink, h, cancel_marked=False)  # replayed, not answered yet
        batch = Batch()
        self.core.queue_unanswered(batch, h)
        return h, batch


class CoreSetting:
    """A driver attribute that is the core's setting of the same name (`producer.timeout_s = 5` sets the
    core's): the drivers keep their historical attributes, the core keeps the one copy."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.core, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.core, self.name, value)


class CoreSettings:
    """The settings both drivers expose (see ProducerCore)."""

    core: ProducerCore
    prefill_chunk = CoreSetting()
    max_lag = CoreSetting()
    backpressure = CoreSetting()
    timeout_s = CoreSetting()
    max_attempts = CoreSetting()
    verify_route = CoreSetting()
    lag_cache_s = CoreSetting()
    discover_cache_s = CoreSetting()
    signer = CoreSetting()
    cancel_ttl_s = CoreSetting()
    record_ttl_s = CoreSetting()
    decode_n = CoreSetting()

    @property
    def _lag(self) -> dict[str, tuple[float, int]]:
        return self.core.lag

    @property
    def _discovered(self) -> dict[str, tuple[float, WorkerInfo]]:
        return self.core.discovered


def _one_hop(h: SessionHandle) -> None:
    if len(h.spec.route) > 1:  # producer/route.py drives those
        raise ValueError("a route of several hops is driven by run_many / generate (docs/routes.md), "
                         "not step by step")


def read_on(h: SessionHandle, entries: Iterable[tuple[Any, Any]]) -> Iterator[StepResult]:
    """The session's results among a result stream's entries (records of rows, schemas/wire.py), in
    order, moving h.last_result_id past every entry (an undecodable one included, so it is never read
    again)."""
    sid = h.session_id
    for entry_id, fields in entries:
        h.last_result_id = decode_str(entry_id)
        try:
            rows = results_from_fields(fields)
        except WireError:
            continue
        for r in rows:
            if r.session_id == sid:
                yield r
