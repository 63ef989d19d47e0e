"""The Tracker-side client on asyncio: `AsyncProducer`, the same operations as `Producer`, as coroutines.

Every decision is made by the sans-I/O core (producer/core.py), exactly as in the synchronous driver; this
module only awaits Redis (`redis.asyncio`) and routes results to the tasks that wait for them.

Many tasks at once
------------------
`generate()` and `run_many()` do not read their own result streams. One reader task per worker
(`_WorkerReader`) does ONE XREAD (BLOCK) over the result streams of all the sessions being driven on that
worker, applies the results to their handles, pushes every session's next step (decode, or a replay after
`state_lost`) in ONE pipeline, then hands each session its results through its own queue. So a thousand
`async for token in producer.generate(spec, prompt)` cost one XREAD and one pipeline per fused batch of the
worker, as `run_many` does. A session that joins while the reader is blocked wakes it (the read in flight
is cancelled: reads start from each stream's last seen id, so a cancelled read loses nothing). The reader
ends when it drives no session, and starts again with the next one. Opens (and other pushes) of many
tasks that come at the same time are sent together: one pipeline per worker per event-loop turn
(`_Outbox`).

Handles driven by a reader belong to it: call `read_results()` / `push_decode()` yourself only on handles
you drive by hand (the manual flow, as with `Producer`).

Timeouts: `ResultTimeout` is raised to the sessions of a worker from which no result at all arrived for
`timeout_s` (a session waiting for a slot behind others is not timed out while the worker answers them);
time spent in a Redis outage does not count. Outages: every call rides through them (schemas/retry.py);
after one, the reader re-pushes what its sessions have unanswered and reads on from their last ids.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis

from schemas import SessionSpec, Signer, StepResult, WorkerKeys
from schemas.keys import WORKERS_INDEX
from schemas.limits import CANCEL_MARKER_TTL_S, OUTAGE_MAX_S, SESSION_RECORD_TTL_S
from schemas.retry import OutageRider, RetryPolicy

from . import route_drivers
from .core import (
    DECODE_N,
    READ_COUNT,
    Batch,
    CoreSettings,
    ProducerCore,
    ResultTimeout,
    SessionFailed,
    SessionHandle,
    WorkerInfo,
    decode_str,
)
from .route import RouteHandle
from .validate import check_id

__all__ = ["AsyncProducer"]

log = logging.getLogger("dgr.producer")
T = TypeVar("T")
OnResult = Callable[[SessionHandle, StepResult], "Awaitable[None] | None"]


@dataclass(eq=False)
class _Follow:
    """One session driven by a reader: its handle, and the queue its task waits on (lists of results
    applied, or the exception that ends it)."""

    h: SessionHandle
    replay_state_lost: bool
    on_result: OnResult | None
    queue: asyncio.Queue[list[StepResult] | BaseException] = field(default_factory=asyncio.Queue)


class _Outbox:
    """Pushes of one worker queued during one event-loop turn, sent as one pipeline (a MULTI/EXEC when one
    of them asks for a transaction: the sessions' commands share the worker's hash tag)."""

    def __init__(self, producer: AsyncProducer) -> None:
        self.producer = producer
        self.pending: list[tuple[Batch, asyncio.Future[None]]] = []
        self.transaction = False
        self.flushing: set[asyncio.Task[None]] = set()

    async def send(self, batch: Batch, transaction: bool) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.pending:  # the first push of this loop turn: flush once the other tasks had theirs queued
            asyncio.get_running_loop().call_soon(self._start_flush)
        self.pending.append((batch, fut))
        self.transaction |= transaction
        await fut

    def _start_flush(self) -> None:
        task = asyncio.ensure_future(self._flush())
        self.flushing.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self.flushing.discard)

    async def _flush(self) -> None:
        pending, transaction = self.pending, self.transaction
        self.pending, self.transaction = [], False
        merged = Batch()
        for batch, _ in pending:
            merged.ops.extend(batch.ops)
        try:
            await self.producer._send_now(merged, transaction=transaction)
        except BaseException as e:
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(e)
            return
        for _, fut in pending:
            if not fut.done():
                fut.set_result(None)


class _WorkerReader:
    """Reads the result streams of every session driven on one worker, one XREAD at a time (see the
    module docstring)."""

    def __init__(self, producer: AsyncProducer, worker_id: str) -> None:
        self.producer = producer
        self.worker_id = worker_id
        self.follows: dict[str, _Follow] = {}  # by result stream key
        self.task: asyncio.Task[None] | None = None
        self.read: asyncio.Future[Any] | None = None  # the XREAD in flight
        self.woken = False
        self.last = time.monotonic()  # the last result (or join, or outage end): the timeout's start

    def join(self, f: _Follow) -> None:
        if not self.follows:
            self.last = time.monotonic()
        self.follows[f.h.results_key] = f
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self.run())
        elif self.read is not None and not self.read.done():
            self.woken = True  # read the new stream now, not when the blocked read returns
            self.read.cancel()

    def leave(self, f: _Follow) -> None:
        if self.follows.get(f.h.results_key) is f:
            del self.follows[f.h.results_key]

    async def _xread(self, streams: dict[str, str], block_ms: int | None) -> Any:
        client = self.producer.client
        return await self.producer._io(lambda: client.xread(streams, count=READ_COUNT,  # type: ignore[arg-type]
                                                            block=block_ms))

    async def run(self) -> None:
        try:
            await self._loop()
        except BaseException as e:  # Redis down longer than outage_max_s, a bug: every waiter is told
            for f in list(self.follows.values()):
                f.queue.put_nowait(e if isinstance(e, Exception) else RuntimeError(f"result reader ended: {e!r}"))
            self.follows.clear()
            if not isinstance(e, Exception):
                raise

    async def _loop(self) -> None:
        p = self.producer
        core = p.core
        outages = p.outages
        while self.follows:
            by_key = {k: f.h for k, f in self.follows.items()}
            left = core.timeout_s - (time.monotonic() - self.last)
            block = max(1, min(p.read_block_ms, int(left * 1000))) if p.read_block_ms > 0 else None
            self.woken = False
            self.read = asyncio.ensure_future(self._xread({k: h.last_result_id for k, h in by_key.items()}, block))
            try:
                resp = await self.read
            except asyncio.CancelledError:
                if not self.woken:
                    raise
                continue  # a session joined: read again with its stream
            finally:
                self.read = None
            if p.outages != outages:
                outages, self.last = p.outages, time.monotonic()
                await self._after_outage()
                continue
            got = core.apply_read(by_key, [resp])
            if not got:
                if time.monotonic() - self.last > core.timeout_s:
                    self._time_out()
                elif p.read_block_ms <= 0:
                    await asyncio.sleep(p.poll_s)  # no blocking read (fakeredis): poll
                continue
            # Redis 7.0 wakes a client blocked on many streams with the first stream only; the rest of the
            # fused batch's results were written by the same script: take them now (as run_many does).
            more = core.apply_read(by_key, [await self._xread({k: h.last_result_id for k, h in by_key.items()},
                                                              None)])
            for sid, rs in more.items():
                got.setdefault(sid, []).extend(rs)
            self.last = time.monotonic()
            await self._step(got)

    async def _step(self, got: dict[str, list[StepResult]]) -> None:
        """Each session that got results: its callbacks, its next job (all in one pipeline), then its task
        is handed the results (after the push, so the next step is on its way first)."""
        p = self.producer
        batch = Batch()
        touched = []
        for sid, results in got.items():
            f = self.follows.get(p_key(self.worker_id, sid))
            if f is None:
                continue
            if f.on_result is not None:
                for r in results:
                    out = f.on_result(f.h, r)
                    if inspect.isawaitable(out):
                        await out
            await p._advance(batch, f.h, f.replay_state_lost)
            touched.append((f, results))
        await p._send(batch, worker_id=self.worker_id)
        for f, results in touched:
            f.queue.put_nowait(results)
            if f.h.finished:
                self.leave(f)

    async def _after_outage(self) -> None:
        live = [f.h for f in self.follows.values() if not f.h.finished]
        await self.producer._after_outage(live, {f.h.session_id: f.replay_state_lost for f in self.follows.values()})

    def _time_out(self) -> None:
        n = len(self.follows)
        for f in list(self.follows.values()):
            f.queue.put_nowait(ResultTimeout(
                f"session {f.h.session_id}: no result from worker {self.worker_id} for {self.producer.timeout_s} s "
                f"({n} sessions waiting)"))
        self.follows.clear()


def p_key(worker_id: str, session_id: str) -> str:
    return WorkerKeys(worker_id).results(session_id)


class AsyncProducer(CoreSettings):
    """Tracker-side client on asyncio, safe to use from many tasks at once (see the module docstring).

    `client`: a `redis.asyncio.Redis` (or RedisCluster). `read_block_ms`: the longest a reader's XREAD
    blocks (0: never block, poll every `poll_s`, for servers whose blocking reads do not work). The other
    options are `Producer`'s."""

    def __init__(self, client: aioredis.Redis, *, prefill_chunk: int = 512, max_lag: int | None = 10_000,
                 backpressure: Literal["raise", "wait"] = "raise", timeout_s: float = 60.0,
                 max_attempts: int = 3, verify_route: bool = True, lag_cache_s: float = 0.1,
                 discover_cache_s: float = 1.0, signer: Signer | None = None, outage_max_s: float = OUTAGE_MAX_S,
                 cancel_ttl_s: int = CANCEL_MARKER_TTL_S, record_ttl_s: int = SESSION_RECORD_TTL_S,
                 decode_n: int = DECODE_N,
                 read_block_ms: int = 1000,
                 poll_s: float = 0.002) -> None:
        self.core = ProducerCore(prefill_chunk=prefill_chunk, max_lag=max_lag, backpressure=backpressure,
                                 timeout_s=timeout_s, max_attempts=max_attempts, verify_route=verify_route,
                                 lag_cache_s=lag_cache_s, discover_cache_s=discover_cache_s, signer=signer,
                                 cancel_ttl_s=cancel_ttl_s, record_ttl_s=record_ttl_s, decode_n=decode_n)
        self.client = client
        self.read_block_ms = read_block_ms
        self.poll_s = poll_s
        self._rider = OutageRider(RetryPolicy(max_s=outage_max_s), log, "producer")
        self._readers: dict[str, _WorkerReader] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._asking: dict[tuple[str, str], asyncio.Future[Any]] = {}  # one question in flight per key

    async def _io(self, fn: Callable[[], Awaitable[T]]) -> T:
        """await fn(), retried through a Redis outage (schemas/retry.py). fn must be idempotent."""
        return await self._rider.acall(fn)

    async def _once(self, key: tuple[str, str], fn: Callable[[], Awaitable[T]]) -> T:
        """One question to Redis for every task asking it at the same time (a thousand opens, one
        discovery and one lag check)."""
        fut = self._asking.get(key)
        if fut is None:
            fut = self._asking[key] = asyncio.ensure_future(fn())
            fut.add_done_callback(lambda _: self._asking.pop(key, None))
        return await asyncio.shield(fut)

    @property
    def outages(self) -> int:
        """Redis outages this producer rode through."""
        return self._rider.outages

    async def aclose(self) -> None:
        """Stop the readers (their sessions' tasks get CancelledError-free RuntimeErrors) and close nothing
        else: the client is the caller's."""
        for r in list(self._readers.values()):
            if r.task is not None and not r.task.done():
                r.task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await r.task
        self._readers.clear()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------- discovery

    async def discover(self, worker_id: str) -> WorkerInfo:
        """The worker's advertised keys and info, and its heartbeat. LookupError if it never advertised."""
        k = WorkerKeys(check_id(worker_id, "worker_id"))

        async def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(k.spec)
            pipe.get(k.heartbeat)
            return await pipe.execute()

        spec_raw, hb_raw = await self._once(("discover", worker_id), partial(self._io, ask))
        info = WorkerInfo.parse(worker_id, spec_raw, hb_raw)
        if info is None:
            raise LookupError(f"worker {worker_id!r} has not advertised (no {k.spec})")
        self.core.remember(info)
        return info

    async def workers(self) -> list[WorkerInfo]:
        """Every worker in WORKERS_INDEX that has an advertisement, by id."""
        ids = sorted(decode_str(x) for x in await self._io(lambda: self.client.smembers(WORKERS_INDEX)))
        if not ids:
            return []

        async def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for w in ids:
                pipe.get(WorkerKeys(w).spec)
                pipe.get(WorkerKeys(w).heartbeat)
            return await pipe.execute()

        replies = await self._io(ask)
        infos = (WorkerInfo.parse(w, replies[2 * i], replies[2 * i + 1]) for i, w in enumerate(ids))
        return [info for info in infos if info is not None]

    # ---------------------------------------------------------------- backpressure

    async def _input_lag(self, stream: str) -> int:
        lag = self.core.cached_lag(stream)
        if lag is not None:
            return lag

        async def ask() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
            return await pipe.execute(raise_on_error=False)

        length, groups = await self._once(("lag", stream), partial(self._io, ask))
        return self.core.record_lag(stream, length, groups)

    async def _admit(self, stream: str, *, wait: bool) -> bool:
        """Producer._admit, awaited: the sleep lets other tasks run."""
        core = self.core
        if core.max_lag is None or core.within_lag(await self._input_lag(stream)):
            return True
        if not wait:
            return False
        if core.backpressure == "raise":
            raise core.over_lag(stream)
        deadline = time.monotonic() + core.timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(max(core.lag_cache_s, 0.01))
            if core.within_lag(await self._input_lag(stream)):
                return True
        raise core.over_lag(stream, core.timeout_s)

    # ---------------------------------------------------------------- pushing

    async def _new_handle(self, spec: SessionSpec, prompt: Sequence[int], hop: int) -> SessionHandle:
        self.core.check_shape(spec, prompt, hop)
        worker = self.core.route_worker_to_discover(spec, hop)
        if worker is not None:
            await self.discover(worker)
        return self.core.new_handle(spec, prompt, hop)

    async def open(self, spec: SessionSpec, prompt: Sequence[int], hop: int = 0) -> SessionHandle:
        """Producer.open: validate, check backpressure, push the prompt's prefill chunks and the
        session's record in one transaction (shared with the opens of other tasks at the same time)."""
        h = await self._new_handle(spec, prompt, hop)
        await self._admit(h.input_stream("prefill"), wait=True)
        batch = Batch()
        self.core.queue_prefill(batch, h)
        await self._send(batch, worker_id=h.worker_id, transaction=True)
        return h

    async def push_decode(self, h: SessionHandle, token: int) -> str:
        """Producer.push_decode (a handle you drive by hand)."""
        token = self.core.check_decode_token(h, token)
        batch = Batch()
        jid = self.core.queue_decode(batch, h, token)
        await self._send(batch, worker_id=h.worker_id)
        return jid

    async def replay(self, h: SessionHandle) -> None:
        """Producer.replay (a handle you drive by hand)."""
        if not isinstance(h, SessionHandle):
            raise TypeError(f"h must be a SessionHandle, not {type(h).__name__}")
        batch = Batch()
        self.core.queue_replay(batch, h, cancel_marked=await self.cancelled(h.worker_id, h.session_id))
        if h.jobs:
            await self._send(batch, worker_id=h.worker_id, transaction=True)

    async def _send(self, batch: Batch, *, worker_id: str, transaction: bool = False) -> None:
        """Send through the worker's outbox: with the other tasks' pushes of this loop turn, one pipeline."""
        if not batch.ops:
            return
        box = self._outboxes.get(worker_id)
        if box is None:
            box = self._outboxes[worker_id] = _Outbox(self)
        await box.send(batch, transaction)

    async def _send_now(self, batch: Batch, *, transaction: bool = False) -> None:
        """One pipeline, again as a whole after an outage (idempotent: see Producer._send)."""
        if batch.ops:
            await self._io(lambda: batch.apply_to(self.client.pipeline(transaction=transaction)).execute())

    async def cancel(self, worker_id: str, session_id: str) -> None:
        """Producer.cancel: the cancel marker and the cancel event, in one transaction."""
        batch = Batch()
        self.core.cancel_ops(batch, worker_id, session_id)
        await self._send_now(batch, transaction=True)

    async def cancel_route(self, h: RouteHandle) -> None:
        """Cancel a session on every hop of its route (one transaction per worker)."""
        await route_drivers.acancel_route(self, h)

    async def cancelled(self, worker_id: str, session_id: str) -> bool:
        """Whether the session's cancel marker is set (by this or any other process)."""
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        marker = keys.cancel_marker(check_id(session_id, "session_id"))
        return bool(await self._io(lambda: self.client.exists(marker)))

    # ---------------------------------------------------------------- results

    async def read_results(self, handles: Sequence[SessionHandle],
                           block_ms: int = 1000) -> dict[str, list[StepResult]]:
        """Producer.read_results (handles you drive by hand): one XREAD per worker, the workers' reads
        concurrent; BLOCK block_ms (<= 0: do not block), returning as soon as one worker's read has results
        (the others are cancelled: a read starts from each handle's last seen id, so nothing is lost)."""
        if isinstance(block_ms, bool) or not isinstance(block_ms, int):
            raise TypeError(f"block_ms must be an int, not {type(block_ms).__name__}")
        self.core.check_handles(handles)
        by_worker = self.core.by_worker(handles)

        async def one(by_key: dict[str, SessionHandle]) -> Any:
            streams = {k: h.last_result_id for k, h in by_key.items()}
            return await self._io(lambda: self.client.xread(streams, count=READ_COUNT,  # type: ignore[arg-type]
                                                             block=block_ms if block_ms > 0 else None))

        reads = [asyncio.ensure_future(one(bk)) for bk in by_worker.values()]
        pending = set(reads)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.result() for t in done):
                    break
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        resps = [t.result() for t in reads if t.done() and not t.cancelled()]
        return self.core.apply_read({k: h for bk in by_worker.values() for k, h in bk.items()}, resps)

    async def _advance(self, batch: Batch, h: SessionHandle, replay_state_lost: bool) -> bool:
        marked = (self.core.needs_cancel_check(h, replay_state_lost)
                  and await self.cancelled(h.worker_id, h.session_id))
        return self.core.advance(batch, h, replay_state_lost, cancel_marked=marked)

    async def _after_outage(self, live: Sequence[SessionHandle], replay: dict[str, bool]) -> None:
        """Producer._after_outage, for one worker's sessions."""
        batch = Batch()
        n = self.core.after_outage(batch, live)
        for h in live:
            await self._advance(batch, h, replay.get(h.session_id, True))
        log.warning("re-pushed unanswered jobs after a redis outage", extra={"sessions": len(live), "jobs": n})
        await self._send_now(batch)

    # ---------------------------------------------------------------- drivers

    def _reader(self, worker_id: str) -> _WorkerReader:
        r = self._readers.get(worker_id)
        if r is None:
            r = self._readers[worker_id] = _WorkerReader(self, worker_id)
        return r

    async def _follow(self, h: SessionHandle, *, replay_state_lost: bool = True,
                      on_result: OnResult | None = None) -> AsyncGenerator[list[StepResult], None]:
        """The results of an open handle as its worker's reader applies them, until it is finished."""
        f = _Follow(h, replay_state_lost, on_result)
        reader = self._reader(h.worker_id)
        reader.join(f)
        try:
            while not h.finished:
                item = await f.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.leave(f)

    async def generate(self, spec: SessionSpec, prompt: Sequence[int]) -> AsyncIterator[int]:
        """`async for token in producer.generate(spec, prompt)`: Producer.generate on asyncio. Replays
        after state_lost (up to max_attempts); raises SessionFailed on rejected/failed, ResultTimeout
        when its worker answers nothing for timeout_s; rides through Redis outages."""
        if len(spec.route) > 1:  # a route of several hops: producer/route.py
            async for token in route_drivers.agenerate_route(self, spec, prompt):
                yield token
            return
        h = await self.open(spec, prompt)
        sent = 0
        follow = self._follow(h)
        try:
            async for _results in follow:
                while sent < len(h.generated):  # it may grow while we are suspended in a yield
                    sent += 1
                    yield h.generated[sent - 1]
        finally:
            await follow.aclose()
        if h.status not in ("finished", "cancelled"):
            raise SessionFailed(h)

    async def run_many(self, sessions: Sequence[tuple[SessionSpec, Sequence[int]]],
                       on_result: OnResult | None = None, replay_state_lost: bool = True,
                       start_times: Sequence[float] | None = None, resume: Sequence[SessionHandle] = (),
                       ) -> dict[str, SessionHandle]:
        """Producer.run_many on asyncio: each session opens at its start time (seconds from the call) and
        is driven by its worker's reader; `on_result` may be a coroutine function. Backpressure on opening:
        "raise" raises, "wait" waits until the stream's lag is within the bound. Returns the handles by
        session id (resumed first, then in the order given)."""
        if any(len(spec.route) > 1 for spec, _ in sessions) and not resume:  # routes of several hops
            return dict(await route_drivers.arun_routes(self, sessions, on_result=on_result,
                                                        replay_state_lost=replay_state_lost, start_times=start_times))
        if start_times is not None and len(start_times) != len(sessions):
            raise ValueError("start_times must give one time per session")
        ids = [spec.session_id for spec, _ in sessions] + [h.session_id for h in resume]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate session ids")
        times = list(start_times) if start_times is not None else [0.0] * len(sessions)
        opened: dict[str, SessionHandle] = {}
        t0 = time.monotonic()

        async def drive(h: SessionHandle) -> None:
            async for _ in self._follow(h, replay_state_lost=replay_state_lost, on_result=on_result):
                pass

        async def start(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + times[i] - time.monotonic()))
            spec, prompt = sessions[i]
            if self.backpressure == "wait":  # defer the open until the worker catches up
                h = await self._new_handle(spec, prompt, 0)
                while not await self._admit(h.input_stream("prefill"), wait=False):
                    await asyncio.sleep(max(self.lag_cache_s, 0.01))
                batch = Batch()
                self.core.queue_prefill(batch, h)
                await self._send(batch, worker_id=h.worker_id, transaction=True)
            else:
                h = await self.open(spec, prompt)
            opened[spec.session_id] = h
            await drive(h)

        tasks = [asyncio.ensure_future(drive(h)) for h in resume]
        tasks += [asyncio.ensure_future(start(i)) for i in range(len(sessions))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        out = {h.session_id: h for h in resume}
        out.update((spec.session_id, opened[spec.session_id]) for spec, _ in sessions)
        return out

    async def drive(self, handles: Sequence[SessionHandle], on_result: OnResult | None = None,
                    replay_state_lost: bool = True) -> dict[str, SessionHandle]:
        """Drive handles already open (e.g. rebuilt by `resume()`) until all are finished."""
        return await self.run_many([], on_result=on_result, replay_state_lost=replay_state_lost, resume=handles)

    async def resume(self, worker_id: str, session_id: str) -> SessionHandle:
        """Producer.resume: rebuild a session's handle from its record and result stream (the core's
        Resumer), then re-push what is unanswered."""
        keys = WorkerKeys(worker_id)
        record = await self._io(lambda: self.client.hgetall(keys.session_record(session_id)))
        rebuild = self.core.resumer(worker_id, session_id, record)
        while rebuild.cursor is not None:
            page: Any = await self._io(partial(self.client.xrange, rebuild.h.results_key, min=rebuild.cursor,
                                               count=READ_COUNT))
            rebuild.feed(page)
        h, batch = rebuild.finish()
        await self._send_now(batch)
        return h
