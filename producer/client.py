"""`Producer`: the Tracker side on redis-py, synchronous: it runs the core's plans (producer/core.py) and loops;
every decision is the core's. Not thread-safe: drive it from one thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from schemas import SessionSpec, StepResult
from schemas.direct import Direct, serving

from .commands import Batch, Plan, Read, Sleep
from .errors import SessionFailed
from .placement import SessionTemplate
from .session import SessionHandle, Sessions
from .settings import ProducerSettings
from .tracker import TrackerOps, execute

__all__ = ["Producer"]

T = TypeVar("T")
log = logging.getLogger("dgr.producer")
OnResult = Callable[[SessionHandle, StepResult], None]


class Producer(TrackerOps):
    """The Tracker-side client on a `redis.Redis` (or RedisCluster); `settings` (or keyword options):
    ProducerSettings. The operations: producer/tracker.py; the loops: `run_many`, `generate`, `drive`, `poll`."""

    def __init__(self, client: redis.Redis, settings: ProducerSettings | None = None, **options: Any) -> None:
        super().__init__(client, settings, **options)
        # the loop turns' reads and pushes on a kept connection (a redis.Redis's only: schemas/direct.py Direct.of)
        self._direct = Direct.of(client)

    def _call(self, plan: Plan[T]) -> T:
        reply: Any = None
        try:
            while True:
                req = plan.send(reply)
                reply = None
                if isinstance(req, Batch):
                    self._send(req)
                elif isinstance(req, Sleep):
                    time.sleep(req.seconds)
                else:
                    reply = self._io(req)
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    def _io(self, req: Read | Batch, transaction: bool | None = None) -> Any:
        n = self._rider.outages
        try:
            direct = serving(self._direct, self.client)
            return self._rider.call(lambda: execute(self.client, req, transaction, direct))
        finally:
            if self._rider.outages != n:
                self.core.outage = True

    def _send(self, batch: Batch, *, transaction: bool = False) -> None:
        """Send queued writes as one pipeline (MULTI/EXEC when asked), again as a whole after an outage."""
        if batch.ops:
            self._io(batch, transaction or batch.transaction)

    def run_many(self, sessions: Sessions, on_result: OnResult | None = None,
                 replay_state_lost: bool = True, start_times: Sequence[float] | None = None,
                 resume: Sequence[SessionHandle] = ()) -> dict[str, SessionHandle]:
        """Drive sessions (routes of any length) from this thread until every one has ended; the handles by id.

        Each session opens at its start time (seconds from the call; default all at once); each loop reads
        every result stream once (one XREAD per worker), applies the answers, pushes every session's next job
        (a decode job, a relay to the next hop, a replay after state_lost) in ONE pipeline, and only then calls
        `on_result(handle, result)` for each answer. Backpressure on opening: "raise" raises Backpressure, "wait"
        defers the open. `resume`: handles already open (e.g. from `resume()`). ResultTimeout when a worker the
        sessions wait on answers nothing for timeout_s."""
        run = self.core.start(sessions, start_times, resume, replay_state_lost, on_result is not None)
        t0 = time.monotonic()
        try:
            while True:
                due = run.due(time.monotonic() - t0)
                if due:
                    self._call(self.core.open_many(run, due, wait=self.settings.backpressure == "raise"))
                if run.done:
                    return run.out()
                until = run.until_next(time.monotonic() - t0)
                if not run.live:
                    time.sleep(min(0.05, max(until, 0.005)) if until is not None else 0.05)
                    continue
                self._turn(until)
                for h, r in run.take():
                    on_result(h, r)  # type: ignore[misc]  # results are collected only with a callback
                self._raise(run)
        finally:
            self.core.stop(run)
            self._release()

    def drive(self, handles: Sequence[SessionHandle], on_result: OnResult | None = None,
              replay_state_lost: bool = True) -> dict[str, SessionHandle]:
        """Drive handles already open (e.g. rebuilt by `resume()`) until all have ended."""
        return self.run_many([], on_result=on_result, replay_state_lost=replay_state_lost, resume=handles)

    def generate(self, spec: SessionSpec | SessionTemplate, prompt: Sequence[int]) -> Iterator[int]:
        """Drive one session (a route of any length) and yield its tokens as they arrive (a stop token that ended
        it included). Replays after state_lost (up to max_attempts); SessionFailed when it ends rejected or
        failed, ResultTimeout when its worker answers nothing for timeout_s."""
        run = self.core.start([(spec, prompt)])
        try:
            self._call(self.core.open_many(run, run.due(0.0), wait=True))
            h = run.handles[spec.session_id]
            sent = 0
            while True:
                while sent < len(h.generated):
                    sent += 1
                    yield h.generated[sent - 1]
                if h.finished:
                    break
                self._turn(None)
                self._raise(run)
        finally:
            self.core.stop(run)
            self._release()
        if h.status not in ("finished", "cancelled"):
            raise SessionFailed(h)

    def poll(self, handles: Sequence[SessionHandle], block_ms: int = 0, replay_state_lost: bool = True) -> None:
        """One turn of run_many's loop over handles driven by hand (for a Tracker with a loop of its own, and tests
        that step a worker and the Tracker in turn): read, apply, push every next job."""
        run = self.core.start([], resume=[h for h in handles if not h.finished], replay=replay_state_lost)
        try:
            self._call(self.core.turn(block_ms))
        finally:
            self.core.stop(run, abandon=False)  # the handles let go of the run: driven by hand again

    def _release(self) -> None:
        """Cancel the sessions a loop left before they ended (a timeout, an exception, the caller stopped): an
        error here does not hide the one that ended the loop; what was not sent goes with the next turn."""
        try:
            self._call(self.core.release_abandoned())
        except Exception:
            log.warning("cancels of abandoned sessions not sent yet", exc_info=True)

    def _turn(self, until: float | None) -> None:
        block = self.core.block_ms(until)
        if not self._call(self.core.turn(block)) and block <= 0:
            time.sleep(self.settings.poll_s)

    def _raise(self, run: Any) -> None:
        self.core.expire()
        if run.error is not None:
            raise run.error
