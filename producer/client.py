"""The Tracker-side client, synchronous: open sessions, push step jobs, read results, cancel, replay.

Every decision is made by the sans-I/O core (producer/core.py); this module only talks to Redis (redis-py,
blocking) and loops. `producer.aio.AsyncProducer` is the same over `redis.asyncio`.

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

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Literal, TypeVar

import redis

from schemas import SessionSpec, Signer, StepResult, WorkerKeys
from schemas.keys import WORKERS_INDEX
from schemas.limits import CANCEL_MARKER_TTL_S, OUTAGE_MAX_S, SESSION_RECORD_TTL_S
from schemas.retry import OutageRider, RetryPolicy

from . import route_drivers
from .core import (
    DECODE_N,
    READ_COUNT,
    Backpressure,
    Batch,
    CoreSettings,
    ProducerCore,
    ResultTimeout,
    SessionFailed,
    SessionHandle,
    WorkerInfo,
    decode_str,
    job_id,
)
from .route import RouteHandle
from .validate import check_id

__all__ = [
    "Backpressure", "Producer", "ResultTimeout", "SessionFailed", "SessionHandle", "WorkerInfo", "job_id",
]

_Batch = Batch  # the name tests and subclasses know (a Batch of queued commands)
log = logging.getLogger("dgr.producer")
T = TypeVar("T")


class Producer(CoreSettings):
    """Tracker-side client. Not thread-safe: drive it from one thread (run_many does, for many sessions)."""

    def __init__(self, client: redis.Redis, *, prefill_chunk: int = 512, max_lag: int | None = 10_000,
                 backpressure: Literal["raise", "wait"] = "raise", timeout_s: float = 60.0,
                 max_attempts: int = 3, verify_route: bool = True, lag_cache_s: float = 0.1,
                 discover_cache_s: float = 1.0, signer: Signer | None = None, outage_max_s: float = OUTAGE_MAX_S,
                 cancel_ttl_s: int = CANCEL_MARKER_TTL_S, record_ttl_s: int = SESSION_RECORD_TTL_S,
                 decode_n: int = DECODE_N) -> None:
        """`signer`: sign every entry written (schemas/signing.py), for workers that require it.
        `decode_n`: tokens per decode job (a continuation job, producer/credit.py); 1: one job per token."""
        self.core = ProducerCore(prefill_chunk=prefill_chunk, max_lag=max_lag, backpressure=backpressure,
                                 timeout_s=timeout_s, max_attempts=max_attempts, verify_route=verify_route,
                                 lag_cache_s=lag_cache_s, discover_cache_s=discover_cache_s, signer=signer,
                                 cancel_ttl_s=cancel_ttl_s, record_ttl_s=record_ttl_s, decode_n=decode_n)
        self.client = client
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
        info = WorkerInfo.parse(worker_id, spec_raw, hb_raw)
        if info is None:
            raise LookupError(f"worker {worker_id!r} has not advertised (no {k.spec})")
        self.core.remember(info)
        return info

    def workers(self) -> list[WorkerInfo]:
        """Every worker in WORKERS_INDEX that has an advertisement, by id."""
        ids = sorted(decode_str(x) for x in self._io(lambda: self.client.smembers(WORKERS_INDEX)))
        if not ids:
            return []

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for w in ids:
                pipe.get(WorkerKeys(w).spec)
                pipe.get(WorkerKeys(w).heartbeat)
            return pipe.execute()

        replies = self._io(ask)
        infos = (WorkerInfo.parse(w, replies[2 * i], replies[2 * i + 1]) for i, w in enumerate(ids))
        return [info for info in infos if info is not None]

    # ---------------------------------------------------------------- backpressure

    def _input_lag(self, stream: str) -> int:
        lag = self.core.cached_lag(stream)
        if lag is not None:
            return lag

        def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            return pipe.execute(raise_on_error=False)

        length, groups = self._io(ask)
        return self.core.record_lag(stream, length, groups)

    def _admit(self, stream: str, *, wait: bool) -> bool:
        """True when the stream's lag is within max_lag. wait=False: answer at once; wait=True:
        apply the configured policy (raise Backpressure, or wait up to timeout_s then raise)."""
        core = self.core
        if core.max_lag is None or core.within_lag(self._input_lag(stream)):
            return True
        if not wait:
            return False
        if core.backpressure == "raise":
            raise core.over_lag(stream)
        deadline = time.monotonic() + core.timeout_s
        while time.monotonic() < deadline:
            time.sleep(max(core.lag_cache_s, 0.01))
            if core.within_lag(self._input_lag(stream)):
                return True
        raise core.over_lag(stream, core.timeout_s)

    # ---------------------------------------------------------------- pushing

    def _new_handle(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> SessionHandle:
        self.core.check_shape(spec, prompt, hop)
        worker = self.core.route_worker_to_discover(spec, hop)
        if worker is not None:
            self.discover(worker)
        return self.core.new_handle(spec, prompt, hop)

    def _queue_unanswered(self, batch: Batch, h: SessionHandle) -> int:
        return self.core.queue_unanswered(batch, h)

    def open(self, spec: SessionSpec, prompt: Sequence[int], hop: int = 0) -> SessionHandle:
        """Validate (hop, tokens, context, the worker advertises the key), check backpressure on the
        prefill stream, and push the prompt as prefill chunks (<= prefill_chunk tokens each; the
        SessionSpec on the first, sample=True only on the last) in ONE pipeline (MULTI/EXEC)."""
        h = self._new_handle(spec, prompt, hop)
        self._admit(h.input_stream("prefill"), wait=True)
        batch = Batch()
        self.core.queue_prefill(batch, h)
        self._send(batch, transaction=True)
        return h

    def push_decode(self, h: SessionHandle, token: int) -> str:
        """Push the decode step at h.position feeding `token`; returns its job id. Decode steps are
        not held back by backpressure: an admitted session has one job in flight at most."""
        token = self.core.check_decode_token(h, token)
        batch = Batch()
        jid = self.core.queue_decode(batch, h, token)
        self._send(batch)
        return jid

    def replay(self, h: SessionHandle) -> None:
        """After state_lost: attempt + 1, re-open with prompt + generated as the prompt, continue.
        Raises SessionFailed when max_attempts is spent. A session whose cancel marker is set is not
        replayed: it ends `cancelled`. See the module docstring."""
        if not isinstance(h, SessionHandle):
            raise TypeError(f"h must be a SessionHandle, not {type(h).__name__}")
        batch = Batch()
        self.core.queue_replay(batch, h, cancel_marked=self.cancelled(h.worker_id, h.session_id))
        if h.jobs:
            self._send(batch, transaction=True)

    def _send(self, batch: Batch, *, transaction: bool = False) -> None:
        """Send the queued commands as one pipeline, again as a whole after an outage (idempotent:
        pushes carry job ids the worker answers once; the record is a plain overwrite)."""
        if not batch.ops:
            return
        self._io(lambda: batch.apply_to(self.client.pipeline(transaction=transaction)).execute())

    def cancel(self, worker_id: str, session_id: str) -> None:
        """Cancel the session: set its cancel marker (TTL cancel_ttl_s) and XADD the session id to
        the worker's cancellation stream (MAXLEN ~), in one transaction. The marker makes the cancel
        win over a step not yet admitted (an opening not yet read, a worker that is down, a replay).
        Both ids must be ids (docs/wire-format.md): anything else is refused here, before a key is built."""
        batch = Batch()
        self.core.cancel_ops(batch, worker_id, session_id)
        self._io(lambda: batch.apply_to(self.client.pipeline(transaction=True)).execute())

    def cancel_route(self, h: RouteHandle) -> None:
        """Cancel a session on every hop of its route (one transaction per worker)."""
        route_drivers.cancel_route(self, h)

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
        self.core.check_handles(handles)
        by_worker = self.core.by_worker(handles)
        if not by_worker:
            return {}
        if len(by_worker) == 1:
            (by_key,) = by_worker.values()
            streams = {k: h.last_result_id for k, h in by_key.items()}
            resps = [self._io(lambda: self.client.xread(streams, count=READ_COUNT,  # type: ignore[arg-type]
                                                        block=block_ms if block_ms > 0 else None))]
        else:
            deadline = time.monotonic() + max(0, block_ms) / 1000

            def poll() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for by_key in by_worker.values():
                    pipe.xread({k: h.last_result_id for k, h in by_key.items()}, count=READ_COUNT)
                return pipe.execute()

            while True:
                resps = self._io(poll)
                if any(resps) or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        return self.core.apply_read({k: h for bk in by_worker.values() for k, h in bk.items()}, resps)

    def _advance(self, batch: Batch, h: SessionHandle, replay_state_lost: bool) -> bool:
        """Queue the session's next job, if any (ProducerCore.advance). True when something was queued."""
        marked = (self.core.needs_cancel_check(h, replay_state_lost)
                  and self.cancelled(h.worker_id, h.session_id))
        return self.core.advance(batch, h, replay_state_lost, cancel_marked=marked)

    # ---------------------------------------------------------------- drivers

    def _after_outage(self, live: Sequence[SessionHandle], replay_state_lost: bool) -> None:
        """Redis answered again: re-push every live session's unanswered jobs (idempotent), and queue
        the next step of sessions whose last result was read but not acted on. Result streams are
        read on from each handle's last seen id."""
        batch = Batch()
        n = self.core.after_outage(batch, live)
        for h in live:
            self._advance(batch, h, replay_state_lost)
        log.warning("re-pushed unanswered jobs after a redis outage", extra={"sessions": len(live), "jobs": n})
        self._send(batch)

    def generate(self, spec: SessionSpec, prompt: Sequence[int]) -> Iterator[int]:
        """Drive one session step by step, yield its tokens as results arrive, stop when finished.
        Replays after state_lost (up to max_attempts); raises SessionFailed on rejected/failed,
        ResultTimeout when no result arrives for timeout_s. Tokens are yielded as the worker
        sampled them (a stop token that ended the session included). Rides through Redis outages
        (see the module docstring)."""
        if len(spec.route) > 1:  # a route of several hops: producer/route.py
            yield from route_drivers.generate_route(self, spec, prompt)
            return
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
            batch = Batch()
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
        if any(len(spec.route) > 1 for spec, _ in sessions) and not resume:  # routes of several hops
            return dict(route_drivers.run_routes(self, sessions, on_result=on_result,
                                                 replay_state_lost=replay_state_lost, start_times=start_times))
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
            batch = Batch()
            now = time.monotonic()
            while waiting and times[waiting[0]] <= now - t0:
                spec, prompt = sessions[waiting[0]]
                h = self._new_handle(spec, prompt, 0)
                # "raise": _admit raises Backpressure; "wait": defer this open to a later loop.
                if not self._admit(h.input_stream("prefill"), wait=self.backpressure == "raise"):
                    break
                self.core.queue_prefill(batch, h)
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
            batch = Batch()
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
        record = self._io(lambda: self.client.hgetall(keys.session_record(session_id)))
        rebuild = self.core.resumer(worker_id, session_id, record)
        while rebuild.cursor is not None:
            page: Any = self._io(partial(self.client.xrange, rebuild.h.results_key, min=rebuild.cursor,
                                         count=READ_COUNT))
            rebuild.feed(page)
        h, batch = rebuild.finish()
        self._send(batch)
        return h
