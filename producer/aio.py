"""`AsyncProducer`: the Tracker side on `redis.asyncio`, safe from many tasks at once. It runs the core's plans
(producer/core.py), as `Producer` does; what differs is its event loop.

One pump task drives every session of every run_many / generate / drive call: it reads this Tracker's result
stream on each worker (one XREAD per worker), applies the answers, pushes every next job in ONE pipeline, then
wakes the tasks whose sessions moved. A thousand `async for token in producer.generate(...)` cost one read and
one pipeline per completion call of the worker. Callbacks (`on_result`, a coroutine function or not) run in the
run_many task, never in the pump: a slow callback never holds a session's next job back. Pushes of many tasks
in one loop turn go out together (one pipeline, one MULTI/EXEC per worker for openings), and equal questions in
flight together (a thousand openings: one discovery, one lag check) are asked once. The pump ends when it
drives no session and starts again with the next one. Handles it drives belong to it: call `read_results()` /
`push_decode()` only on handles driven by hand.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, suppress
from typing import Any, TypeVar

import redis.asyncio as aioredis

from schemas import SessionSpec, StepResult

from .commands import Batch, Get, Plan, PTtl, Read, Sleep, XInfoGroups, XLen
from .core import Run
from .errors import SessionFailed
from .placement import SessionTemplate
from .session import SessionHandle, Sessions
from .settings import ProducerSettings
from .tracker import TrackerOps, aexecute

__all__ = ["Answers", "AsyncProducer"]

T = TypeVar("T")
log = logging.getLogger("dgr.producer")
OnResult = Callable[[SessionHandle, StepResult], "Awaitable[None] | None"]
_ASKED_ONCE = (Get, PTtl, XLen, XInfoGroups)  # reads many tasks ask at once: one question in flight per equal Read


class Answers:
    """`AsyncProducer.stream_many`: `async for handle, result in answers`; `handles` (by session id, in the order
    given) once it has ended; `aclose()` to leave early."""

    def __init__(self, answers: AsyncGenerator[tuple[SessionHandle, StepResult], None], run: Run) -> None:
        self._answers, self._run = answers, run

    def __aiter__(self) -> AsyncGenerator[tuple[SessionHandle, StepResult], None]:
        return self._answers

    async def aclose(self) -> None:
        await self._answers.aclose()

    @property
    def handles(self) -> dict[str, SessionHandle]:
        return self._run.out()


class AsyncProducer(TrackerOps):
    """The Tracker-side client on a `redis.asyncio.Redis` (or RedisCluster); `settings` (or keyword options):
    ProducerSettings. Every operation is a coroutine (`await producer.open(...)`)."""

    def __init__(self, client: aioredis.Redis, settings: ProducerSettings | None = None, **options: Any) -> None:
        super().__init__(client, settings, **options)
        self._pump: asyncio.Task[None] | None = None
        self._reading: asyncio.Future[Any] | None = None  # the pump's read in flight
        self._streams: set[str] = set()  # what that read reads
        self._asking: dict[Read, asyncio.Future[Any]] = {}
        self._outbox: dict[str | None, tuple[Batch, asyncio.Task[None]]] = {}  # the pushes of this loop turn
        self._flushing: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the pump (its sessions' callers get a RuntimeError); the client is the caller's to close."""
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await self._pump

    # ---------------------------------------------------------------- running plans

    async def _call(self, plan: Plan[T]) -> T:
        reply: Any = None
        try:
            while True:
                req = plan.send(reply)
                reply = None
                if isinstance(req, Batch):
                    await self._push(req)
                elif isinstance(req, Sleep):
                    await asyncio.sleep(req.seconds)
                elif all(isinstance(c, _ASKED_ONCE) for c in req.cmds):
                    reply = await self._once(req)
                else:
                    reply = await self._io(req)
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    async def _io(self, req: Read | Batch) -> Any:
        n = self._rider.outages
        try:
            return await self._rider.acall(lambda: aexecute(self.client, req))
        finally:
            if self._rider.outages != n:
                self.core.outage = True

    async def _once(self, req: Read) -> Any:
        fut = self._asking.get(req)
        if fut is None:
            fut = self._asking[req] = asyncio.ensure_future(self._io(req))
            fut.add_done_callback(lambda _: self._asking.pop(req, None))
        return await asyncio.shield(fut)

    async def _push(self, batch: Batch) -> None:
        """With the other tasks' pushes of this loop turn: one pipeline (one MULTI/EXEC per worker for
        transactions, their keys in one hash tag)."""
        key = batch.tag if batch.transaction else None
        if key not in self._outbox:  # the send starts once the tasks ready in this loop turn have pushed
            task = asyncio.ensure_future(self._flush(key))
            self._flushing.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self._flushing.discard)
            self._outbox[key] = (Batch(transaction=key is not None, tag=key), task)
        merged, sending = self._outbox[key]
        merged.ops.extend(batch.ops)
        await asyncio.shield(sending)  # a caller cancelled leaves the others' send alone

    async def _flush(self, key: str | None) -> None:
        await self._io(self._outbox.pop(key)[0])

    # ---------------------------------------------------------------- the pump

    def _wake(self) -> None:
        """Start the pump, or make its read in flight start again when it misses a stream (a new worker, the reply
        stream of a resumed session): a read starts from the cursors, nothing is lost."""
        if self._pump is None or self._pump.done():
            if self.core.driven:
                self._pump = asyncio.ensure_future(self._pumping())
        elif self._reading is not None and not self._reading.done() \
                and not self._streams.issuperset(s for r in self.core.reads.values() for s in r):
            self._reading.cancel()

    async def _pumping(self) -> None:
        core = self.core
        try:
            while core.driven:
                block = core.block_ms()
                self._streams = {s for r in core.reads.values() for s in r}
                self._reading = asyncio.ensure_future(self._call(core.read((), block)))
                try:
                    got = await self._reading
                except asyncio.CancelledError:
                    if self._pump is not None and self._pump.cancelling():
                        raise
                    continue  # woken: read again, with the new streams
                finally:
                    self._reading = None
                touched = await self._call(core.advance_touched())
                for run in {h.run for h in touched if h.run is not None}:
                    run.waker.set()
                for run in core.expire():
                    run.waker.set()
                if not got and block <= 0:
                    await asyncio.sleep(self.settings.poll_s)
        except BaseException as e:  # Redis down longer than outage_max_s, a bug: every waiting caller is told
            for run in {h.run for h in core.driven.values()}:
                run.error = run.error or (e if isinstance(e, Exception) else RuntimeError(f"the pump ended: {e!r}"))
                core.stop(run)
                run.waker.set()
            raise

    # ---------------------------------------------------------------- driving sessions

    async def _release(self) -> None:
        """Producer._release on asyncio: cancel the sessions a loop left before they ended."""
        try:
            await self._call(self.core.release_abandoned())
        except Exception:
            log.warning("cancels of abandoned sessions not sent yet", exc_info=True)

    async def _start(self, run: Run, due: list[int]) -> None:
        if due:
            await self._call(self.core.open_many(run, due, wait=self.settings.backpressure == "raise"))
        self._wake()

    async def run_many(self, sessions: Sessions, on_result: OnResult | None = None,
                       replay_state_lost: bool = True, start_times: Sequence[float] | None = None,
                       resume: Sequence[SessionHandle] = ()) -> dict[str, SessionHandle]:
        """Producer.run_many on asyncio: every session opens at its start time and the pump drives it; the
        callbacks run here (a coroutine's awaited), after the pump pushed the next jobs, in each session's order:
        a callback sees its handle as it is then (the pump may have moved it on: read the result's fields). The
        handles by id (resumed first, then in the order given)."""
        run = self.core.start(sessions, start_times, resume, replay_state_lost, on_result is not None)
        async with aclosing(self._answers(run)) as answers:
            async for h, r in answers:
                assert on_result is not None  # a run collects answers only for a callback
                out = on_result(h, r)
                if inspect.isawaitable(out):
                    await out
        return run.out()

    def stream_many(self, sessions: Sessions, replay_state_lost: bool = True,
                    start_times: Sequence[float] | None = None) -> Answers:
        """run_many as an async iterator: (handle, result) per answer as it comes, in the task that iterates
        (no callback task and no queue between the pump and a caller that streams each answer on: `dgr serve`).
        Closing it early (`aclose()`, or the task cancelled) stops driving the sessions left and cancels them on
        their workers, as a cancelled run_many does; `handles` once it has ended."""
        run = self.core.start(sessions, start_times, (), replay_state_lost, True)
        return Answers(self._answers(run), run)

    async def _answers(self, run: Run) -> AsyncGenerator[tuple[SessionHandle, StepResult], None]:
        """Drive `run` to its end: its answers (a run that collects them) as they come."""
        run.waker = asyncio.Event()
        t0 = time.monotonic()
        first = True
        try:
            while True:
                due = run.due(time.monotonic() - t0)
                if due or first or self._pump is None or self._pump.done():
                    # opening sessions, or the pump to start: its read follows the streams of what it drives
                    await self._start(run, due)
                    first = False
                for answer in run.take():
                    yield answer
                if run.error is not None:
                    raise run.error
                if run.done:
                    return
                until = run.until_next(time.monotonic() - t0)
                with suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(run.waker.wait(), None if until is None else max(until, 0.005))
                run.waker.clear()
        finally:
            self.core.stop(run)
            await self._release()

    async def drive(self, handles: Sequence[SessionHandle], on_result: OnResult | None = None,
                    replay_state_lost: bool = True) -> dict[str, SessionHandle]:
        """Drive handles already open (e.g. rebuilt by `resume()`) until all have ended."""
        return await self.run_many([], on_result=on_result, replay_state_lost=replay_state_lost, resume=handles)

    async def generate(self, spec: SessionSpec | SessionTemplate, prompt: Sequence[int]) -> AsyncIterator[int]:
        """`async for token in producer.generate(spec, prompt)`: Producer.generate on asyncio."""
        run = self.core.start([(spec, prompt)])
        run.waker = asyncio.Event()
        try:
            await self._call(self.core.open_many(run, run.due(0.0), wait=True))
            self._wake()
            h = run.handles[spec.session_id]
            sent = 0
            while True:
                while sent < len(h.generated):  # it may grow while this task is suspended in a yield
                    sent += 1
                    yield h.generated[sent - 1]
                if h.finished:
                    break
                if run.error is not None:
                    raise run.error
                await run.waker.wait()
                run.waker.clear()
        finally:
            self.core.stop(run)
            await self._release()
        if h.status not in ("finished", "cancelled"):
            raise SessionFailed(h)
