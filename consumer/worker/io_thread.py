"""The worker's I/O thread: Redis round trips that overlap the engine call.

One thread, so the transport is used by one thread at a time and a session's results stay in order:
the loop hands it the next read (prefetched while fused call k runs: the engine releases the GIL) and
call k's completion (filed while the loop admits and runs call k+1), in that order, and waits for it
(`drain`) before it uses the transport itself (the heartbeat, recovery, a blocking read when idle).
An error on the thread (a lease lost, an outage given up on) is raised in the loop's thread when the
loop next collects a result or drains.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["IOThread"]

T = TypeVar("T")


class IOThread:
    def __init__(self, name: str) -> None:
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future[Any]] = deque()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._name)
        f = self._pool.submit(fn)
        self._pending.append(f)
        return f

    @property
    def busy(self) -> bool:
        return any(not f.done() for f in self._pending)

    def drain(self) -> None:
        """Wait for everything handed to the thread; the first error is raised here."""
        first: BaseException | None = None
        while self._pending:
            f = self._pending.popleft()
            try:
                f.result()
            except BaseException as e:  # every future is waited for before the first error goes on
                first = first or e
        if first is not None:
            raise first

    def collect(self, f: Future[T]) -> T:
        """The result of one submitted call (waiting for it). Its error, or that of a call handed over
        before it, is raised here."""
        f.exception()  # wait
        while self._pending and self._pending[0].done():
            done = self._pending.popleft()
            if done.exception() is not None:
                self._pending.clear()
                raise done.exception()  # type: ignore[misc]
        return f.result()

    def close(self) -> None:
        """Wait for the call running; what was handed over and has not started is dropped (after an error:
        a normal stop drains first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
