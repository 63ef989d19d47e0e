"""The worker's I/O thread: Redis round trips that overlap the engine call.

One thread, so the transport is used by one thread at a time and a session's results stay in order:
the loop hands it the next read (prefetched while fused call k runs: the engine releases the GIL) and
call k's completion (filed while the loop admits and runs call k+1), in that order, and waits for it
(`drain`) before it uses the transport itself (the heartbeat, recovery, a blocking read when idle).
An error on the thread (a lease lost, an outage given up on) is raised in the loop's thread when the
loop next collects a result or drains.

A hand-over is a job on a `queue.SimpleQueue` and a lock the thread releases when the job is done (`Handed`), not
a `ThreadPoolExecutor`'s Future (a Condition, its lock and waiter list, the pool's own bookkeeping at each
submit): two hand-overs every fused call, each about half the CPU of the pool's (26.5 against 52.6 us a submit
and its wait, both threads, a /tmp script on this host; docs/benchmarks.md, issue 32).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any, Generic, TypeVar

__all__ = ["Handed", "IOThread", "Skipped"]

T = TypeVar("T")


class Skipped(Exception):
    """The job was handed over but never ran: the thread was closed first."""


class Handed(Generic[T]):
    """One job handed to the I/O thread, and its outcome once it ran (its value, or what it raised)."""

    __slots__ = ("_done", "_error", "_fn", "_value")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()  # released once, by the thread, when the job ran (or was skipped)

    def _run(self, skip: bool) -> None:
        fn, self._fn = self._fn, None
        try:
            if skip or fn is None:
                self._error = Skipped("the I/O thread was closed before this job ran")
            else:
                self._value = fn()
        except BaseException as e:  # raised in the loop's thread, where it collects or drains
            self._error = e
        finally:
            self._done.release()

    def done(self) -> bool:
        return not self._done.locked()

    def exception(self) -> BaseException | None:
        """What the job raised (None: it returned), once it ran (waiting for it)."""
        if self._done.locked():
            with self._done:
                pass
        return self._error

    def result(self) -> T:
        error = self.exception()
        if error is not None:
            raise error
        return self._value  # type: ignore[return-value]  # ran without error: its value


class IOThread:
    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: SimpleQueue[Handed[Any] | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._pending: deque[Handed[Any]] = deque()

    def submit(self, fn: Callable[[], T]) -> Handed[T]:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._serve, name=f"{self._name}_0", daemon=True)
            self._thread.start()
        h = Handed(fn)
        self._pending.append(h)
        self._jobs.put(h)
        return h

    def _serve(self) -> None:
        while True:
            h = self._jobs.get()
            if h is None:
                return
            h._run(skip=self._closing)

    @property
    def busy(self) -> bool:
        return any(not h.done() for h in self._pending)

    def drain(self) -> None:
        """Wait for everything handed to the thread; the first error is raised here."""
        first: BaseException | None = None
        while self._pending:
            error = self._pending.popleft().exception()  # every job is waited for before the first error goes on
            first = first or error
        if first is not None:
            raise first

    def collect(self, h: Handed[T]) -> T:
        """The result of one submitted call (waiting for it). Its error, or that of a call handed over
        before it, is raised here."""
        h.exception()  # wait
        while self._pending and self._pending[0].done():
            error = self._pending.popleft().exception()
            if error is not None:
                self._pending.clear()
                raise error
        return h.result()

    def close(self) -> None:
        """Wait for the call running; what was handed over and has not started is dropped (after an error:
        a normal stop drains first)."""
        if self._thread is not None:
            self._closing = True
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
            self._jobs = SimpleQueue()
        self._pending.clear()
