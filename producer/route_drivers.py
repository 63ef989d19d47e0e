"""The I/O loops that drive routes of several hops over RouteCore (producer/route.py): sync and asyncio.

One loop turn, for all the sessions being driven:
  1. read: one XREAD per worker owing answers, over the sessions' result streams on that worker (its keys
     share one hash tag: Cluster safe), all in one pipeline whose last XREAD (the worker owing the most)
     BLOCKs: a route's answers come from several workers, and one blocking XREAD cannot wait on two hash
     tags, so a result of another worker waits at most a tenth of the usual gap between answers
     (BLOCK_MS..MAX_BLOCK_MS): a slow engine is not robbed of CPU by a spinning Tracker;
  2. fetch: GET every output blob named by the answers read, one pipeline;
  3. push: every session's next jobs (relays with their blobs, decode steps at hop 0, replays, releases) in
     one pipeline, not a transaction (its keys span several workers' tags).
Per fused call of a hop that is 3 round trips for the Tracker (read, fetch, push), 2 when every answer was
inline (a decode step). Outages: every call rides through them (the producer's OutageRider); after one,
every session's unanswered jobs are pushed again, blobs included (same job ids, same bytes).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from schemas import SessionSpec, StepResult

from .core import READ_COUNT, Batch, ResultTimeout, SessionFailed, read_streams
from .route import RouteCore, RouteHandle

if TYPE_CHECKING:
    from .aio import AsyncProducer
    from .client import Producer

__all__ = ["acancel_route", "agenerate_route", "arun_routes", "cancel_route", "generate_route", "run_routes"]

POLL_S = 0.0005  # the asyncio driver's pause between two empty polls of the result streams
BLOCK_MS = 2  # with answers owed by several workers: the shortest wait on one before the others are read again
MAX_BLOCK_MS = 20  # ... and the longest (a tenth of the usual gap between answers in between)


def _turn(core: RouteCore, live: Sequence[RouteHandle], resps: Sequence[Any],
          by_worker: dict[str, dict[str, tuple[RouteHandle, str]]], batch: Batch,
          on_result: Callable[[RouteHandle, StepResult], None] | None) -> list[RouteHandle]:
    """Apply XREAD replies (in the order of by_worker's workers); the sessions that got results."""
    touched: dict[str, RouteHandle] = {}
    for (worker, by_key), resp in zip(by_worker.items(), resps, strict=True):
        for name, entries in read_streams(resp):
            key = name.decode() if isinstance(name, bytes) else name
            h, _ = by_key[key]
            for r in core.apply_entries(h, worker, entries, batch):
                touched[h.session_id] = h
                if on_result is not None:
                    on_result(h, r)
    return list(touched.values())


def _gets(pipe: Any, keys: Sequence[str]) -> Any:
    for k in keys:
        pipe.get(k)
    return pipe


async def _aexecute(p: AsyncProducer, fill: Callable[[Any], Any]) -> Any:
    return await fill(p.client.pipeline(transaction=False)).execute()


def _xreads(pipe: Any, by_worker: dict[str, dict[str, tuple[RouteHandle, str]]], block_ms: int | None = None) -> Any:
    """One XREAD per worker, from each session's current cursor on that worker; the last one (the worker
    that owes the most answers) BLOCKs block_ms when given. In one pipeline, Redis answers the others
    first, then waits on that one: one blocked round trip instead of a spinning poll (a blocking XREAD
    over several workers' streams would span hash tags, which Redis Cluster refuses)."""
    items = list(by_worker.items())
    for i, (w, by_key) in enumerate(items):
        block = block_ms if i == len(items) - 1 else None
        pipe.xread({k: h.cursors[w] for k, (h, _) in by_key.items()}, count=READ_COUNT, block=block)
    return pipe


class _SyncRoutes:
    """One run of `run_routes` on a sync Producer."""

    def __init__(self, p: Producer, on_result: Callable[[RouteHandle, StepResult], None] | None,
                 replay_state_lost: bool) -> None:
        self.p = p
        self.core = RouteCore(p.core)
        self.on_result = on_result
        self.replay = replay_state_lost
        self.gap_s = 0.0  # moving average of the time between two reads that brought answers
        self.answered_at = time.monotonic()

    def block_ms(self) -> int:
        return int(min(MAX_BLOCK_MS, max(BLOCK_MS, self.gap_s * 100)))

    def execute(self, fill: Callable[[Any], Any]) -> Any:
        """One pipeline (not a transaction): `fill` queues its commands."""
        return fill(self.p.client.pipeline(transaction=False)).execute()

    def send(self, batch: Batch) -> None:
        if batch.ops:
            self.p._io(lambda: batch.apply_to(self.p.client.pipeline(transaction=False)).execute())

    def open(self, spec: SessionSpec, prompt: Sequence[int], batch: Batch, *, wait: bool) -> RouteHandle | None:
        self.core.core.check_shape(spec, prompt, 0)
        for w in self.core.route_workers_to_discover(spec):
            self.p.discover(w)
        h = self.core.new_handle(spec, prompt)
        if not self.p._admit(h.input_stream("prefill"), wait=wait):
            return None
        self.core.queue_open(batch, h)
        return h

    def read(self, live: Sequence[RouteHandle], block_ms: int) -> tuple[list[RouteHandle], Batch]:
        """Poll the live sessions' result streams until something arrives or block_ms passed."""
        deadline = time.monotonic() + max(0, block_ms) / 1000
        batch = Batch()
        while True:
            by_worker = self.core.by_worker(live)
            left_ms = max(1, int((deadline - time.monotonic()) * 1000))
            # one worker: block on it as long as asked; several: block on the busiest for a tenth of the
            # usual gap between answers (BLOCK_MS..MAX_BLOCK_MS), so the poll costs the engines little CPU
            block = left_ms if len(by_worker) == 1 else min(self.block_ms(), left_ms)
            resps = self.p._io(partial(self.execute, partial(_xreads, by_worker=by_worker, block_ms=block)))
            touched = _turn(self.core, live, resps, by_worker, batch, self.on_result)
            if touched:
                now = time.monotonic()
                self.gap_s += 0.2 * (now - self.answered_at - self.gap_s)
                self.answered_at = now
            if touched or time.monotonic() >= deadline:
                return touched, batch

    def fetch(self, touched: Sequence[RouteHandle], batch: Batch) -> None:
        """GET the output blobs the answers named (one pipeline) and queue the relays."""
        wanted = [k for keys in self.core.fetches(touched).values() for k in keys]
        blobs: dict[str, bytes | None] = {}
        if wanted:
            blobs = dict(zip(wanted, self.p._io(partial(self.execute, partial(_gets, keys=wanted))), strict=True))
        for h in touched:
            if h.relays:
                self.core.relay(batch, h, blobs)

    def advance(self, batch: Batch, h: RouteHandle) -> None:
        marked = (self.replay and h.status == "state_lost" and not h.finished
                  and self.p.cancelled(h.worker_id, h.session_id))
        self.core.advance(batch, h, self.replay, cancel_marked=marked)

    def after_outage(self, live: Sequence[RouteHandle]) -> None:
        batch = Batch()
        for h in live:
            self.core.queue_unanswered(batch, h)
        self.fetch([h for h in live if h.relays], batch)
        for h in live:
            self.advance(batch, h)
        self.send(batch)


def run_routes(p: Producer, sessions: Sequence[tuple[SessionSpec, Sequence[int]]],
               on_result: Callable[[RouteHandle, StepResult], None] | None = None,
               replay_state_lost: bool = True, start_times: Sequence[float] | None = None) -> dict[str, RouteHandle]:
    """Drive sessions over their routes (one or several hops each) until all ended; see Producer.run_many."""
    if start_times is not None and len(start_times) != len(sessions):
        raise ValueError("start_times must give one time per session")
    ids = [spec.session_id for spec, _ in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate session ids")
    d = _SyncRoutes(p, on_result, replay_state_lost)
    times = list(start_times) if start_times is not None else [0.0] * len(sessions)
    waiting = deque(sorted(range(len(sessions)), key=lambda i: times[i]))
    handles: dict[str, RouteHandle] = {}
    t0 = last = time.monotonic()
    outages = p.outages
    while True:
        batch = Batch()
        while waiting and times[waiting[0]] <= time.monotonic() - t0:
            spec, prompt = sessions[waiting[0]]
            h = d.open(spec, prompt, batch, wait=p.backpressure == "raise")
            if h is None:
                break
            handles[h.session_id] = h
            waiting.popleft()
        d.send(batch)
        live = [h for h in handles.values() if not h.finished]
        if p.outages != outages:
            outages, last = p.outages, time.monotonic()
            d.after_outage(live)
            continue
        if not live:
            if not waiting:
                return handles
            time.sleep(max(0.0, min(0.05, times[waiting[0]] - (time.monotonic() - t0))))
            last = time.monotonic()
            continue
        block = p._block_ms(last)
        if waiting:
            block = max(1, min(block, int((times[waiting[0]] - (time.monotonic() - t0)) * 1000)))
        touched, batch = d.read(live, block)
        if not touched:
            if p.outages == outages and time.monotonic() - last > p.timeout_s:
                raise ResultTimeout(f"{len(live)} sessions: no result for {p.timeout_s} s")
            continue
        last = time.monotonic()
        d.fetch(touched, batch)
        for h in touched:
            d.advance(batch, h)
        d.send(batch)


def generate_route(p: Producer, spec: SessionSpec, prompt: Sequence[int]) -> Iterator[int]:
    """Producer.generate over a route: yields the last hop's tokens as they arrive."""
    d = _SyncRoutes(p, None, True)
    batch = Batch()
    h = d.open(spec, prompt, batch, wait=True)
    assert h is not None
    d.send(batch)
    last = time.monotonic()
    outages = p.outages
    while not h.finished:
        n0 = len(h.generated)
        touched, batch = d.read([h], p._block_ms(last))
        yield from h.generated[n0:]
        if p.outages != outages:
            outages, last = p.outages, time.monotonic()
            d.after_outage([h])
            continue
        if not touched:
            if time.monotonic() - last > p.timeout_s:
                raise ResultTimeout(f"session {h.session_id}: no result for {p.timeout_s} s")
            continue
        last = time.monotonic()
        d.fetch(touched, batch)
        d.advance(batch, h)
        d.send(batch)
    if h.status not in ("finished", "cancelled"):
        raise SessionFailed(h)


def cancel_route(p: Producer, h: RouteHandle) -> None:
    """Cancel the session on every hop: marker + event, one transaction per worker (one hash tag each)."""
    for batch in RouteCore(p.core).cancel_ops(h).values():
        p._io(lambda b=batch: b.apply_to(p.client.pipeline(transaction=True)).execute())  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ asyncio


async def arun_routes(p: AsyncProducer, sessions: Sequence[tuple[SessionSpec, Sequence[int]]],
                      on_result: Callable[[RouteHandle, StepResult], Awaitable[None] | None] | None = None,
                      replay_state_lost: bool = True,
                      start_times: Sequence[float] | None = None) -> dict[str, RouteHandle]:
    """run_routes on an AsyncProducer: the same turns over RouteCore, awaited (`on_result` may be a
    coroutine function). One loop for all the sessions; AsyncProducer.run_many and generate use it for
    routes of several hops."""
    if start_times is not None and len(start_times) != len(sessions):
        raise ValueError("start_times must give one time per session")
    ids = [spec.session_id for spec, _ in sessions]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate session ids")
    core = RouteCore(p.core)
    times = list(start_times) if start_times is not None else [0.0] * len(sessions)
    waiting = deque(sorted(range(len(sessions)), key=lambda i: times[i]))

    async def send(batch: Batch) -> None:
        if batch.ops:
            await p._io(partial(_aexecute, p, batch.apply_to))

    handles: dict[str, RouteHandle] = {}
    seen: list[tuple[RouteHandle, StepResult]] = []  # the results of one turn, for on_result

    def collect(h: RouteHandle, r: StepResult) -> None:
        seen.append((h, r))

    t0 = last = time.monotonic()
    outages = p.outages
    while True:
        batch = Batch()
        while waiting and times[waiting[0]] <= time.monotonic() - t0:
            spec, prompt = sessions[waiting.popleft()]
            p.core.check_shape(spec, prompt, 0)
            for w in core.route_workers_to_discover(spec):
                await p.discover(w)
            h = core.new_handle(spec, prompt)
            await p._admit(h.input_stream("prefill"), wait=True)
            core.queue_open(batch, h)
            handles[h.session_id] = h
        await send(batch)
        live = [h for h in handles.values() if not h.finished]
        if not live:
            if not waiting:
                return handles
            await asyncio.sleep(max(0.0, min(0.05, times[waiting[0]] - (time.monotonic() - t0))))
            last = time.monotonic()
            continue
        if p.outages != outages:
            outages, last = p.outages, time.monotonic()
            batch = Batch()
            for h in live:
                core.queue_unanswered(batch, h)
            await send(batch)
        by_worker = core.by_worker(live)
        block = BLOCK_MS if len(by_worker) > 1 or waiting else 100
        resps = await p._io(partial(_aexecute, p, partial(_xreads, by_worker=by_worker, block_ms=block)))
        batch = Batch()
        seen.clear()
        touched = _turn(core, live, resps, by_worker, batch, collect)
        if not touched:
            if p.outages == outages and time.monotonic() - last > p.timeout_s:
                raise ResultTimeout(f"{len(live)} sessions: no result for {p.timeout_s} s")
            continue
        last = time.monotonic()
        if on_result is not None:
            for h, r in seen:
                got = on_result(h, r)
                if inspect.isawaitable(got):
                    await got
        wanted = [k for keys in core.fetches(touched).values() for k in keys]
        blobs: dict[str, bytes | None] = {}
        if wanted:
            blobs = dict(zip(wanted, await p._io(partial(_aexecute, p, partial(_gets, keys=wanted))), strict=True))
        for h in touched:
            if h.relays:
                core.relay(batch, h, blobs)
        for h in touched:
            marked = (replay_state_lost and h.status == "state_lost" and not h.finished
                      and await p.cancelled(h.worker_id, h.session_id))
            core.advance(batch, h, replay_state_lost, cancel_marked=marked)
        await send(batch)


async def agenerate_route(p: AsyncProducer, spec: SessionSpec, prompt: Sequence[int]) -> AsyncIterator[int]:
    """AsyncProducer.generate over a route: the last hop's tokens as they arrive."""
    queue: asyncio.Queue[int | None] = asyncio.Queue()

    def on_result(h: RouteHandle, r: StepResult) -> None:
        if r.token is not None and h.legs and r.worker_id == h.legs[-1].worker_id:
            queue.put_nowait(r.token)

    task = asyncio.ensure_future(arun_routes(p, [(spec, prompt)], on_result=on_result))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (token := await queue.get()) is not None:
            yield token
        h = (await task)[spec.session_id]
    finally:
        task.cancel()
    if h.status not in ("finished", "cancelled"):
        raise SessionFailed(h)


async def acancel_route(p: AsyncProducer, h: RouteHandle) -> None:
    """cancel_route on an AsyncProducer."""
    for batch in RouteCore(p.core).cancel_ops(h).values():
        await p._io(partial(_atransaction, p, batch))


async def _atransaction(p: AsyncProducer, batch: Batch) -> Any:
    return await batch.apply_to(p.client.pipeline(transaction=True)).execute()
