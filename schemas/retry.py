"""Riding through a Redis outage: one policy for both sides (the worker's transport, the producer).

A call that fails because Redis is unreachable or momentarily unable to serve (connection refused or
reset, a timeout, a server still loading its data set, a replica just demoted by a failover, a
cluster resharding, a server refusing writes for now: full, unable to persist, short of replicas)
is retried with exponential backoff and jitter for at most `max_s` seconds; any other error is
raised at once. One log line when an outage starts, one when it ends, one when it is given up.
What a retried call must be: idempotent. dgr's are: pushes carry deterministic job ids the worker
answers once, the completion script is idempotent by job id, reads resume from the last id.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import redis

from .limits import OUTAGE_MAX_S

__all__ = ["OutageListener", "OutageRider", "RetryPolicy", "transient"]

T = TypeVar("T")

# Replies that mean "this server cannot take the command right now", not "the command is wrong". Three of them
# refuse writes only, until the server's state changes: OOM (at its maxmemory under noeviction, the only policy a
# worker starts on: consumer/transport/memory.py; until memory is freed: the Tracker reading and trimming
# results, TTLs, an operator), MISCONF (it cannot persist: a full disk, an RDB or AOF write error) and NOREPLICAS
# (fewer replicas than min-replicas-to-write). What such a reply refused did not happen: a script is refused at
# its first write only, a MULTI/EXEC is aborted whole, and the writes of a pipeline that went through are sent
# again as after a dropped connection (idempotent, above).
_TRANSIENT_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM", "MISCONF", "NOREPLICAS")
# redis-py puts this before the reply of a pipeline's command that failed (`Command # 2 (SET k v) of pipeline
# caused error: MISCONF ...`)
_IN_PIPELINE = " of pipeline caused error: "


# redis-py turns some of those replies into classes (and drops the code from the message); a cluster
# client raises SlotNotCoveredError while no node owns the slot during a failover.
_TRANSIENT_CLASSES: tuple[type[BaseException], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError, redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError, redis.exceptions.OutOfMemoryError,
)


def transient(e: BaseException) -> bool:
    """Whether `e` says Redis is (momentarily) unavailable rather than that the request is wrong."""
    if isinstance(e, _TRANSIENT_CLASSES):
        return True
    if not isinstance(e, redis.ResponseError):
        return False
    said = str(e)
    if said.startswith("Command # ") and _IN_PIPELINE in said:
        said = said.split(_IN_PIPELINE, 1)[1]
    return said.startswith(_TRANSIENT_REPLIES)


@dataclass(frozen=True)
class RetryPolicy:
    max_s: float = OUTAGE_MAX_S  # give up (re-raise) after Redis was unavailable this long
    base_s: float = 0.05  # first delay; doubles up to cap_s; each delay drawn in [d/2, d] (jitter)
    cap_s: float = 2.0


class OutageListener(Protocol):
    """Told when an outage starts and ends (the worker's metrics, consumer/metrics.py). Called on the
    rider's thread, from inside the retry loop: keep it cheap, never raise."""

    def outage_started(self) -> None: ...

    def outage_ended(self, down_s: float) -> None: ...

    def outage_gave_up(self, down_s: float) -> None: ...


class OutageRider:
    """Runs calls through outages under one policy; counts the outages it rode through, and tells its
    `listener` (if any) when one starts, ends, or is given up."""

    def __init__(self, policy: RetryPolicy, log: logging.Logger, who: str,
                 listener: OutageListener | None = None) -> None:
        self.policy = policy
        self.log = log
        self.who = who
        self.listener = listener
        self.outages = 0  # outages that ended (Redis came back)
        self._since: float | None = None
        self._retries = 0
        self._delay = policy.base_s

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, e: BaseException) -> None:
        """Account for a transient failure: log the outage start, sleep the next backoff delay, or
        re-raise `e` once the outage is older than max_s."""
        time.sleep(self.backoff(e))

    def backoff(self, e: BaseException) -> float:
        """`failed` without the sleep: the delay to wait before the next try (an asyncio caller awaits
        it), or `e` re-raised once the outage is older than max_s."""
        now = time.monotonic()
        if self._since is None:
            self._since, self._retries, self._delay = now, 0, self.policy.base_s
            self.log.warning("redis unreachable, retrying", extra={
                "who": self.who, "error": f"{type(e).__name__}: {e}"[:200], "give_up_after_s": self.policy.max_s})
            if self.listener is not None:
                self.listener.outage_started()
        if now - self._since > self.policy.max_s:
            self.log.error("redis unreachable for too long, giving up", extra={
                "who": self.who, "down_s": round(now - self._since, 2), "retries": self._retries})
            if self.listener is not None:
                self.listener.outage_gave_up(now - self._since)
            self._since = None
            raise e
        self._retries += 1
        delay = self._delay * random.uniform(0.5, 1.0)  # jitter: a fleet does not reconnect in step
        self._delay = min(self.policy.cap_s, self._delay * 2)
        return delay

    def succeeded(self) -> bool:
        """Account for a call that worked. True when it ended an outage (logged)."""
        if self._since is None:
            return False
        down_s = time.monotonic() - self._since
        self.log.warning("redis reachable again", extra={
            "who": self.who, "down_s": round(down_s, 2), "retries": self._retries})
        self._since = None
        self.outages += 1
        if self.listener is not None:
            self.listener.outage_ended(down_s)
        return True

    def call(self, fn: Callable[[], T]) -> T:
        while True:
            try:
                out = fn()
            except Exception as e:
                if not transient(e):
                    raise
                self.failed(e)
                continue
            self.succeeded()
            return out

    async def acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`call` for a coroutine: the backoff is awaited, so other tasks run meanwhile. Tasks sharing
        one rider share one outage (one log line when it starts, one when it ends)."""
        while True:
            try:
                out = await fn()
            except Exception as e:
                if not transient(e):
                    raise
                await asyncio.sleep(self.backoff(e))
                continue
            self.succeeded()
            return out
