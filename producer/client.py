"""The Tracker-side client: open sessions, push step jobs, read results, cancel, replay.

A session runs on one route hop (a worker advertising the hop's compatibility key for both phases).
`open()` pushes the prompt as prefill chunks; every result with a token lets the caller (or
`generate()` / `run_many()`) push the next decode step, one job in flight per session.

Job ids are deterministic per (session, hop, phase, position, attempt) (`job_id()`), and the worker
answers each job id once: a second delivery while the first is queued or running is completed with
the same answer, a later one re-sends it (the completion script stores each job id's result once,
SET NX). So pushing the same job twice (a retry after a network error, an `open()` called twice, a
re-push after an outage) yields exactly one result, the real one. The flip side: a job id is
answered once, so to retry a step after an answer, bump the attempt (that is what `replay()` does).

Redis outages
-------------
Every call rides through an outage (schemas/retry.py: backoff with jitter for at most
`outage_max_s`, one log line per outage and per recovery). `run_many` and `generate` keep their
handles: once Redis answers again they re-push every live session's unanswered jobs (idempotent, see
above), push the next step of sessions whose result was read just before the outage, and read each
result stream on from its last seen id.

Resuming from another process
-----------------------------
`open()` (and every replay) also writes the session's record `dgr:{W}:sess:<sid>` (spec, prompt,
attempt; TTL `record_ttl_s`). `Producer.resume(worker_id, session_id)` rebuilds the handle in any
process from that record and the session's result stream (it replays the stream through the same
state machine), re-pushes what is unanswered, and `drive([handle])` (or `run_many(resume=[...])`)
continues it. A session whose result stream was trimmed (over `result_maxlen` results) or expired
cannot be rebuilt (LookupError).

Cancellation is state
---------------------
`cancel()` sets the session's cancel marker `dgr:{W}:cancelled:<sid>` (TTL `cancel_ttl_s`) and adds
the cancel event, in one transaction. The worker answers the opening of a marked session CANCELLED
(a cancel sent before its first job was read, or while the worker was down), and `replay()` of a
marked session does not push anything: the handle ends `cancelled`.

Replaying after `state_lost`
----------------------------
A worker answers `state_lost` (or `rejected` with reason `unknown_session`, which a restarted worker
says about a session it no longer holds) when the session's state is gone. The handle then has
`status == "state_lost"` and is not finished. Call `producer.replay(handle)`: it bumps
`handle.attempt` and re-opens the session on the same hop with `prompt + generated` as the new
prompt (prefill chunks, the SessionSpec's max_tokens reduced by the tokens already generated, its
prompt_len the original prompt's length, so the worker computes the generated positions one row per
call as they were decoded: docs/invariance.md). The last chunk's result carries the next token exactly
as the lost decode step would have (the sampler's random stream depends on (seed, position) only), and
decoding continues from there. Results of the
lost attempt that still arrive are ignored (their job ids belong to the old attempt). `generate()`
and `run_many(replay_state_lost=True)` do this themselves, at most `max_attempts` times per session.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import redis

from schemas import (
    GROUP,
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
    result_from_fields,
)
from schemas.keys import WORKERS_INDEX
from schemas.limits import MAX_POSITION, MAX_TOKENS_PER_JOB
from schemas.retry import OutageRider, RetryPolicy

from .validate import check_id, check_token, check_tokens, vocab_size

__all__ = [
    "Backpressure", "Producer", "ResultTimeout", "SessionFailed", "SessionHandle", "WorkerInfo", "job_id",
]

CANCEL_MAXLEN = 100_000
_READ_COUNT = 1_000  # results read per stream per XREAD
log = logging.getLogger("dgr.producer")
T = TypeVar("T")


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

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    @property
    def results_key(self) -> str:
        return WorkerKeys(self.worker_id).results(self.spec.session_id)

    def input_stream(self, phase: Phase) -> str:
        key = self.spec.route[self.hop].key.for_phase(phase)
        return WorkerKeys(self.worker_id).input_stream(key.digest, phase)


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _streams(resp: Any) -> Iterator[tuple[bytes | str, list[tuple[Any, Any]]]]:
    if not resp:
        return
    if isinstance(resp, dict):  # RESP3
        for name, value in resp.items():
            yield name, (value[0] if value and isinstance(value[0], list) else value)
    else:
        for name, entries in resp:
            yield name, entries


class Producer:
    """Tracker-side client. Not thread-safe: drive it from one thread (run_many does, for many sessions)."""

    def __init__(self, client: redis.Redis, *, prefill_chunk: int = 512, max_lag: int | None = 10_000,
                 backpressure: Literal["raise", "wait"] = "raise", timeout_s: float = 60.0,
                 max_attempts: int = 3, verify_route: bool = True, lag_cache_s: float = 0.1,
                 discover_cache_s: float = 1.0, signer: Signer | None = None, outage_max_s: float = 120.0,
                 cancel_ttl_s: int = 86_400, record_ttl_s: int = 86_400) -> None:
        """`signer`: sign every entry written (schemas/signing.py), for workers that require it."""
        if not 1 <= prefill_chunk <= MAX_TOKENS_PER_JOB:
            raise ValueError(f"prefill_chunk must be in [1, {MAX_TOKENS_PER_JOB}]")
        if backpressure not in ("raise", "wait"):
            raise ValueError("backpressure must be 'raise' or 'wait'")
        self.client = client
        self.prefill_chunk = prefill_chunk
        self.max_lag = max_lag
        self.backpressure = backpressure
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.verify_route = verify_route
        self.lag_cache_s = lag_cache_s
        self.discover_cache_s = discover_cache_s
        self.signer = signer
        self._lag: dict[str, tuple[float, int]] = {}
        self._discovered: dict[str, tuple[float, WorkerInfo]] = {}
        self.cancel_ttl_s = cancel_ttl_s
        self.record_ttl_s = record_ttl_s
        self._rider = OutageRider(RetryPolicy(max_s=outage_max_s), log, "producer")

    def _io(self, fn: Callable[[], T]) -> T:
        """fn(), retried through a Redis outage (schemas/retry.py). fn must be idempotent."""
        return self._rider.call(fn)

    @property
    def outages(self) -> int:
        """Redis outages this producer rode through."""
        return self._rider.outages

    # ---------------------------------------------------------------- discovery

    def discover(self, worker_id: str) -> WorkerInfo:
        """The worker's advertised keys and info, and its heartbeat. LookupError if it never advertised."""
        k = WorkerKeys(check_id(worker_id, "worker_id"))

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(k.spec)
            pipe.get(k.heartbeat)
            return pipe.execute()

        spec_raw, hb_raw = self._io(ask)
        info = self._worker_info(worker_id, spec_raw, hb_raw)
        if info is None:
            raise LookupError(f"worker {worker_id!r} has not advertised (no {k.spec})")
        self._discovered[worker_id] = (time.monotonic(), info)
        return info

    def workers(self) -> list[WorkerInfo]:
        """Every worker in WORKERS_INDEX that has an advertisement, by id."""
        ids = sorted(_s(x) for x in self._io(lambda: self.client.smembers(WORKERS_INDEX)))
        if not ids:
            return []

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for w in ids:
                pipe.get(WorkerKeys(w).spec)
                pipe.get(WorkerKeys(w).heartbeat)
            return pipe.execute()

        replies = self._io(ask)
        out = []
        for i, w in enumerate(ids):
            info = self._worker_info(w, replies[2 * i], replies[2 * i + 1])
            if info is not None:
                out.append(info)
        return out

    @staticmethod
    def _worker_info(worker_id: str, spec_raw: bytes | None, hb_raw: bytes | None) -> WorkerInfo | None:
        if spec_raw is None:
            return None
        spec = json.loads(spec_raw)
        keys = [CompatibilityKey.model_validate_json(json.dumps(k)) for k in spec.get("keys", [])]
        hb = json.loads(hb_raw) if hb_raw is not None else {}
        age = max(0.0, time.time() - float(hb["ts"])) if "ts" in hb else None
        return WorkerInfo(worker_id=worker_id, keys=keys, info=dict(spec.get("info", {})),
                          alive=hb_raw is not None, heartbeat_age_s=age, heartbeat=hb)

    def _check_route(self, spec: SessionSpec, hop: int) -> None:
        worker = spec.route[hop].worker_id
        cached = self._discovered.get(worker)
        if cached is None or time.monotonic() - cached[0] > self.discover_cache_s:
            info = self.discover(worker)
        else:
            info = cached[1]
        key = spec.route[hop].key
        for phase in ("prefill", "decode"):
            d = key.for_phase(phase).digest
            if d not in info.digests:
                raise ValueError(f"worker {worker!r} does not advertise the route's {phase} key {d}")

    # ---------------------------------------------------------------- backpressure

    def _input_lag(self, stream: str) -> int:
        now = time.monotonic()
        cached = self._lag.get(stream)
        if cached is not None and now - cached[0] < self.lag_cache_s:
            return cached[1]
        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            return pipe.execute(raise_on_error=False)

        length, groups = self._io(ask)
        lag = 0 if isinstance(length, Exception) else int(length)
        if not isinstance(groups, Exception):
            for g in groups:
                if _s(g.get("name", b"")) == GROUP and g.get("lag") is not None:
                    lag = int(g["lag"])
        self._lag[stream] = (now, lag)
        return lag

    def _admit(self, stream: str, *, wait: bool) -> bool:
        """True when the stream's lag is within max_lag. wait=False: answer at once; wait=True:
        apply the configured policy (raise Backpressure, or wait up to timeout_s then raise)."""
        if self.max_lag is None:
            return True
        if self._input_lag(stream) <= self.max_lag:
            return True
        if not wait:
            return False
        if self.backpressure == "raise":
            raise Backpressure(f"{stream}: input lag over {self.max_lag}")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(max(self.lag_cache_s, 0.01))
            if self._input_lag(stream) <= self.max_lag:
                return True
        raise Backpressure(f"{stream}: input lag over {self.max_lag} for {self.timeout_s} s")

    # ---------------------------------------------------------------- pushing

    def _vocab(self, worker_id: str) -> int | None:
        """The vocabulary the worker advertised, when this producer has discovered it."""
        cached = self._discovered.get(worker_id)
        return vocab_size(cached[1].info) if cached is not None else None

    def _entry(self, stream: str, fields: dict[str, str]) -> dict[str, str]:
        return self.signer.signed(stream, fields) if self.signer is not None else fields

    def _validate(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> tuple[int, ...]:
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
        if self.verify_route:
            self._check_route(spec, hop)
        return check_tokens(toks, self._vocab(spec.route[hop].worker_id))

    def _new_handle(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> SessionHandle:
        toks = self._validate(spec, prompt, hop)
        return SessionHandle(spec=spec, prompt=toks, worker_id=spec.route[hop].worker_id, hop=hop,
                             opened_at=time.time())

    def _prefill_jobs(self, h: SessionHandle) -> list[StepJob]:
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

    def _queue_prefill(self, pipe: Any, h: SessionHandle) -> None:
        """Push prompt + generated as prefill chunks of the handle's attempt (position 0 on), and the
        session's record (what `resume()` rebuilds a handle from)."""
        h.replayed_generated = len(h.generated)
        stream = h.input_stream("prefill")
        jobs = self._prefill_jobs(h)
        h.jobs = set()
        for job in jobs:
            pipe.xadd(stream, self._entry(stream, job_to_fields(job)))
            h.jobs.add(job.job_id)
        h.pending_job = jobs[-1].job_id
        h.position = jobs[-1].end_position
        h.status = "open"
        h.reason, h.detail = None, ""
        record = WorkerKeys(h.worker_id).session_record(h.session_id)
        pipe.hset(record, mapping={"spec": h.spec.model_dump_json(), "prompt": ",".join(map(str, h.prompt)),
                                   "hop": str(h.hop), "attempt": str(h.attempt)})
        pipe.expire(record, self.record_ttl_s)

    def _decode_job(self, h: SessionHandle, position: int, token: int) -> StepJob:
        key = h.spec.route[h.hop].key.for_phase("decode")
        jid = job_id(h.session_id, h.hop, "decode", position, h.attempt)
        return StepJob(job_id=jid, session_id=h.session_id, hop=h.hop, phase="decode", compat=key.digest,
                       start_position=position, tokens=(token,), sample=True, attempt=h.attempt,
                       created_at=time.time())

    def _queue_unanswered(self, pipe: Any, h: SessionHandle) -> int:
        """Re-push the handle's unanswered jobs of its current attempt (idempotent: same job ids).
        Returns how many."""
        if h.finished or h.status == "state_lost" or not h.jobs:
            return 0
        n = 0
        for job in self._prefill_jobs(h):
            if job.job_id in h.jobs:
                stream = h.input_stream("prefill")
                pipe.xadd(stream, self._entry(stream, job_to_fields(job)))
                n += 1
        if h.pending_job in h.jobs and h.generated and h.position > 0:
            job = self._decode_job(h, h.position - 1, h.generated[-1])
            if job.job_id == h.pending_job:
                stream = h.input_stream("decode")
                pipe.xadd(stream, self._entry(stream, job_to_fields(job)))
                n += 1
        return n

    def _queue_decode(self, pipe: Any, h: SessionHandle, token: int) -> str:
        if h.finished:
            raise ValueError(f"session {h.session_id} is {h.status}")
        job = self._decode_job(h, h.position, token)
        jid = job.job_id
        stream = h.input_stream("decode")
        pipe.xadd(stream, self._entry(stream, job_to_fields(job)))
        h.jobs.add(jid)
        h.pending_job = jid
        h.position += 1
        return jid

    def open(self, spec: SessionSpec, prompt: Sequence[int], hop: int = 0) -> SessionHandle:
        """Validate (hop, tokens, context, the worker advertises the key), check backpressure on the
        prefill stream, and push the prompt as prefill chunks (<= prefill_chunk tokens each; the
        SessionSpec on the first, sample=True only on the last) in ONE pipeline (MULTI/EXEC)."""
        h = self._io(lambda: self._new_handle(spec, prompt, hop))
        self._io(lambda: self._admit(h.input_stream("prefill"), wait=True))

        batch = _Batch()
        self._queue_prefill(batch, h)
        self._send(batch, transaction=True)
        return h

    def push_decode(self, h: SessionHandle, token: int) -> str:
        """Push the decode step at h.position feeding `token`; returns its job id. Decode steps are
        not held back by backpressure: an admitted session has one job in flight at most."""
        if not isinstance(h, SessionHandle):
            raise TypeError(f"h must be a SessionHandle, not {type(h).__name__}")
        token = check_token(token, self._vocab(h.worker_id))
        batch = _Batch()
        jid = self._queue_decode(batch, h, token)
        self._send(batch)
        return jid

    def replay(self, h: SessionHandle) -> None:
        """After state_lost: attempt + 1, re-open with prompt + generated as the prompt, continue.
        Raises SessionFailed when max_attempts is spent. A session whose cancel marker is set is not
        replayed: it ends `cancelled`. See the module docstring."""
        if not isinstance(h, SessionHandle):
            raise TypeError(f"h must be a SessionHandle, not {type(h).__name__}")
        batch = _Batch()
        self._queue_replay(batch, h)
        if h.jobs:
            self._send(batch, transaction=True)

    def _send(self, batch: _Batch, *, transaction: bool = False) -> None:
        """Send the queued commands as one pipeline, again as a whole after an outage (idempotent:
        pushes carry job ids the worker answers once; the record is a plain overwrite)."""
        if not batch.ops:
            return

        def go() -> None:
            pipe = self.client.pipeline(transaction=transaction)
            for name, args, kwargs in batch.ops:
                getattr(pipe, name)(*args, **kwargs)
            pipe.execute()

        self._io(go)

    def _queue_replay(self, pipe: Any, h: SessionHandle, *, check_cancel: bool = True) -> None:
        if check_cancel and self.cancelled(h.worker_id, h.session_id):
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
        self._queue_prefill(pipe, h)

    def cancel(self, worker_id: str, session_id: str) -> None:
        """Cancel the session: set its cancel marker (TTL cancel_ttl_s) and XADD the session id to
        the worker's cancellation stream (MAXLEN ~), in one transaction. The marker makes the cancel
        win over a step not yet admitted (an opening not yet read, a worker that is down, a replay).
        Both ids must be ids (docs/wire-format.md): anything else is refused here, before a key is built."""
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        sid = check_id(session_id, "session_id")
        fields = self._entry(keys.cancellations, cancel_to_fields(sid))

        def send() -> None:
            pipe = self.client.pipeline(transaction=True)
            pipe.set(keys.cancel_marker(sid), "1", ex=self.cancel_ttl_s)
            pipe.xadd(keys.cancellations, fields, maxlen=CANCEL_MAXLEN, approximate=True)  # type: ignore[arg-type]
            pipe.execute()

        self._io(send)

    def cancelled(self, worker_id: str, session_id: str) -> bool:
        """Whether the session's cancel marker is set (by this or any other process)."""
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        return bool(self._io(lambda: self.client.exists(keys.cancel_marker(check_id(session_id, "session_id")))))

    # ---------------------------------------------------------------- results

    def read_results(self, handles: Sequence[SessionHandle], block_ms: int = 1000) -> dict[str, list[StepResult]]:
        """Read the handles' result streams from each handle's last_result_id: ONE XREAD per worker
        (its streams share one hash tag, so this is Redis Cluster safe), BLOCK block_ms when every
        handle is on one worker (<= 0: do not block); with several workers, non-blocking reads in one
        pipeline, polled until block_ms has passed. Applies the results to the handles (generated
        tokens, position, finished, status) and returns the ones of the current attempts, by session
        id. Results of older attempts and undecodable entries are skipped."""
        if isinstance(block_ms, bool) or not isinstance(block_ms, int):
            raise TypeError(f"block_ms must be an int, not {type(block_ms).__name__}")
        for h in handles:
            if not isinstance(h, SessionHandle):
                raise TypeError(f"handles must be SessionHandles, not {type(h).__name__}")
        by_worker: dict[str, dict[str, SessionHandle]] = {}
        for h in handles:
            by_worker.setdefault(h.worker_id, {})[h.results_key] = h
        if not by_worker:
            return {}
        if len(by_worker) == 1:
            (by_key,) = by_worker.values()
            streams = {k: h.last_result_id for k, h in by_key.items()}
            resps = [self._io(lambda: self.client.xread(streams, count=_READ_COUNT,  # type: ignore[arg-type]
                                                        block=block_ms if block_ms > 0 else None))]
        else:
            deadline = time.monotonic() + max(0, block_ms) / 1000
            def poll() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for by_key in by_worker.values():
                    pipe.xread({k: h.last_result_id for k, h in by_key.items()}, count=_READ_COUNT)
                return pipe.execute()

            while True:
                resps = self._io(poll)
                if any(resps) or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        all_keys = {k: h for by_key in by_worker.values() for k, h in by_key.items()}
        out: dict[str, list[StepResult]] = {}
        for resp in resps:
            for name, entries in _streams(resp):
                h = all_keys[_s(name)]
                for entry_id, fields in entries:
                    h.last_result_id = _s(entry_id)
                    try:
                        r = result_from_fields(fields)
                    except WireError:
                        continue
                    if self._apply(h, r):
                        out.setdefault(h.session_id, []).append(r)
        return out

    @staticmethod
    def _apply(h: SessionHandle, r: StepResult) -> bool:
        if r.job_id not in h.jobs or r.session_id != h.session_id:
            return False
        h.jobs.discard(r.job_id)
        h.last_result = r
        if r.status == Status.OK:
            if r.job_id == h.pending_job:
                h.pending_job = None
                if r.token is not None:
                    h.generated.append(r.token)
            if r.finished:
                h.finished, h.status = True, "finished"
        else:
            h.reason, h.detail = (r.reason.value if r.reason else None), r.detail
            h.jobs, h.pending_job = set(), None
            if r.status == Status.STATE_LOST or (r.status == Status.REJECTED
                                                 and r.reason == Reason.UNKNOWN_SESSION):
                h.status = "state_lost"
            else:
                h.finished, h.status = True, r.status.value
        return True

    def _advance(self, pipe: Any, h: SessionHandle, replay_state_lost: bool) -> bool:
        """Queue the session's next job, if any. True when something was queued."""
        if h.finished:
            return False
        if h.status == "state_lost":
            if not replay_state_lost:
                h.finished = True
                return False
            try:
                self._queue_replay(pipe, h)
            except SessionFailed:
                return False
            return bool(h.jobs)
        if h.pending_job is None and not h.jobs:
            if not h.generated:  # an ok sampling result without a token: nothing to feed
                h.finished, h.status, h.detail = True, "failed", "sampling result carried no token"
                return False
            self._queue_decode(pipe, h, h.generated[-1])
            return True
        return False

    # ---------------------------------------------------------------- drivers

    def _after_outage(self, live: Sequence[SessionHandle], replay_state_lost: bool) -> None:
        """Redis answered again: re-push every live session's unanswered jobs (idempotent), and queue
        the next step of sessions whose last result was read but not acted on. Result streams are
        read on from each handle's last seen id."""
        batch = _Batch()
        n = 0
        for h in live:
            n += self._queue_unanswered(batch, h)
            self._advance(batch, h, replay_state_lost)
        log.warning("re-pushed unanswered jobs after a redis outage", extra={"sessions": len(live), "jobs": n})
        self._send(batch)

    def generate(self, spec: SessionSpec, prompt: Sequence[int]) -> Iterator[int]:
        """Drive one session step by step, yield its tokens as results arrive, stop when finished.
        Replays after state_lost (up to max_attempts); raises SessionFailed on rejected/failed,
        ResultTimeout when no result arrives for timeout_s. Tokens are yielded as the worker
        sampled them (a stop token that ended the session included). Rides through Redis outages
        (see the module docstring)."""
        h = self.open(spec, prompt)
        last = time.monotonic()
        outages = self.outages
        while not h.finished:
            n0 = len(h.generated)
            got = self.read_results([h], block_ms=self._block_ms(last))
            yield from h.generated[n0:]
            if self.outages != outages:
                outages, last = self.outages, time.monotonic()
                self._after_outage([h], replay_state_lost=True)
            if not got:
                if time.monotonic() - last > self.timeout_s:
                    raise ResultTimeout(f"session {h.session_id}: no result for {self.timeout_s} s")
                continue
            last = time.monotonic()
            batch = _Batch()
            if self._advance(batch, h, replay_state_lost=True):
                self._send(batch)
            if h.finished and h.status not in ("finished", "cancelled"):
                raise SessionFailed(h)

    def _block_ms(self, last: float) -> int:
        left = self.timeout_s - (time.monotonic() - last)
        return max(1, min(1000, int(left * 1000)))

    def run_many(self, sessions: Sequence[tuple[SessionSpec, Sequence[int]]],
                 on_result: Callable[[SessionHandle, StepResult], None] | None = None,
                 replay_state_lost: bool = True, start_times: Sequence[float] | None = None,
                 resume: Sequence[SessionHandle] = (),
                 ) -> dict[str, SessionHandle]:
        """Drive many sessions concurrently from this one thread until all are finished.

        Each loop: open the sessions whose start time (seconds from the call; default all at once)
        has come, one XREAD over all live result streams, then every session's next job (decode
        step, or a replay after state_lost) in one pipeline. Backpressure on opening: "raise"
        raises, "wait" defers the open to a later loop. `resume`: handles already open (e.g. from
        `resume()`), driven along. Returns the handles by session id. ResultTimeout when live
        sessions get no result for timeout_s (time spent in a Redis outage does not count).
        Rides through Redis outages (see the module docstring)."""
        if start_times is not None and len(start_times) != len(sessions):
            raise ValueError("start_times must give one time per session")
        ids = [spec.session_id for spec, _ in sessions] + [h.session_id for h in resume]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate session ids")
        times = list(start_times) if start_times is not None else [0.0] * len(sessions)
        waiting = deque(sorted(range(len(sessions)), key=lambda i: times[i]))
        handles: dict[str, SessionHandle] = {h.session_id: h for h in resume}
        t0 = last = time.monotonic()
        outages = self.outages
        while True:
            batch = _Batch()
            now = time.monotonic()
            while waiting and times[waiting[0]] <= now - t0:
                spec, prompt = sessions[waiting[0]]
                h = self._new_handle(spec, prompt, 0)
                # "raise": _admit raises Backpressure; "wait": defer this open to a later loop.
                if not self._admit(h.input_stream("prefill"), wait=self.backpressure == "raise"):
                    break
                self._queue_prefill(batch, h)
                handles[h.session_id] = h
                waiting.popleft()
            self._send(batch)
            live = [h for h in handles.values() if not h.finished]
            if self.outages != outages:
                outages, last = self.outages, time.monotonic()
                self._after_outage(live, replay_state_lost)
                continue
            if not live:
                if not waiting:
                    return handles
                time.sleep(max(0.0, min(0.05, times[waiting[0]] - (time.monotonic() - t0))))
                last = time.monotonic()
                continue
            block = self._block_ms(last)
            if waiting:
                block = max(1, min(block, int((times[waiting[0]] - (time.monotonic() - t0)) * 1000)))
            got = self.read_results(live, block_ms=block)
            if not got:
                if self.outages == outages and time.monotonic() - last > self.timeout_s:
                    raise ResultTimeout(f"{len(live)} sessions: no result for {self.timeout_s} s")
                continue
            # Redis 7.0 wakes a client blocked on many streams with the first stream only; the rest
            # of the fused batch's results were written by the same script: take them now, so every
            # session's next step is pushed in the same pipeline and the next fused call is full.
            for sid, more in self.read_results(live, block_ms=0).items():
                got.setdefault(sid, []).extend(more)
            last = time.monotonic()
            batch = _Batch()
            for sid, results in got.items():
                h = handles[sid]
                if on_result is not None:
                    for r in results:
                        on_result(h, r)
                self._advance(batch, h, replay_state_lost)
            self._send(batch)

    def drive(self, handles: Sequence[SessionHandle],
              on_result: Callable[[SessionHandle, StepResult], None] | None = None,
              replay_state_lost: bool = True) -> dict[str, SessionHandle]:
        """Drive handles already open (e.g. rebuilt by `resume()`) until all are finished."""
        return self.run_many([], on_result=on_result, replay_state_lost=replay_state_lost, resume=handles)

    # ---------------------------------------------------------------- resuming in another process

    def resume(self, worker_id: str, session_id: str) -> SessionHandle:
        """Rebuild a session's handle from Redis, in any process: its record (spec, prompt, attempt)
        and its result stream, replayed through the same state machine as `run_many`; then re-push
        its unanswered jobs (idempotent). LookupError when there is no record, or when the result
        stream no longer starts with the session's first answers (trimmed or expired)."""
        keys = WorkerKeys(worker_id)
        rec = {_s(k): _s(v) for k, v in self._io(lambda: self.client.hgetall(keys.session_record(session_id))).items()}
        if "spec" not in rec:
            raise LookupError(f"no record of session {session_id!r} on worker {worker_id!r}")
        spec = SessionSpec.model_validate_json(rec["spec"])
        h = SessionHandle(spec=spec, prompt=tuple(int(t) for t in rec["prompt"].split(",")), worker_id=worker_id,
                          hop=int(rec.get("hop", "0")), opened_at=time.time())
        attempts = int(rec.get("attempt", "0"))
        sink = _Batch()  # the pushes the original driver made: rebuilt, not sent
        self._queue_prefill(sink, h)
        opening = job_id(h.session_id, h.hop, "prefill", 0, 0)
        first: str | None = None
        cursor = "-"
        while True:
            page: Any = self._io(partial(self.client.xrange, h.results_key, min=cursor, count=_READ_COUNT))
            for entry_id, fields in page:
                h.last_result_id = _s(entry_id)
                try:
                    r = result_from_fields(fields)
                except WireError:
                    continue
                first = first or r.job_id
                if self._apply(h, r) and not h.finished:
                    if h.status == "state_lost":
                        if h.attempt < attempts:  # the driver replayed it: follow
                            self._queue_replay(sink, h, check_cancel=False)
                    elif h.pending_job is None and not h.jobs and h.generated:
                        self._queue_decode(sink, h, h.generated[-1])
            if len(page) < _READ_COUNT:
                break
            cursor = "(" + h.last_result_id
        if first is not None and first != opening:
            raise LookupError(f"the result stream of session {session_id!r} no longer starts at its opening")
        if h.status == "state_lost" and h.attempt < attempts:
            self._queue_replay(sink, h, check_cancel=False)  # replayed, not answered yet
        batch = _Batch()
        self._queue_unanswered(batch, h)
        self._send(batch)
        return h


class _Batch:
    """Commands queued while handles move on, sent as one pipeline by `Producer._send` (and sent again
    as a whole after an outage: a redis-py pipeline forgets its commands once executed)."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def xadd(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("xadd", args, kwargs))

    def hset(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("hset", args, kwargs))

    def expire(self, *args: Any, **kwargs: Any) -> None:
        self.ops.append(("expire", args, kwargs))
