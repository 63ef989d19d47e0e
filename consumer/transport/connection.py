"""What every part of the Redis transport shares: the client, the worker's key names, the settings, the
scripts, and the one way to send a request through an outage (`RedisIO.io`).

Riding through Redis faults: every Redis call goes through `io` (schemas/retry.py), which retries
connection errors, timeouts, READONLY / LOADING / MASTERDOWN / TRYAGAIN / CLUSTERDOWN replies with
exponential backoff and jitter for at most `outage_max_s` (and so is a completion too few replicas
acknowledged, with `durable_replicas` set: durable.py), logging one line when an outage starts and
one when it ends (past the bound it logs and re-raises). A stop request (SIGTERM) ends the wait at once
(`Stopping`), and a request still blocked on its socket half a second after it is cut off (unblock.py):
a worker told to stop while Redis is down or hung stops within about a second, leaving its entries
pending for recovery. The caller's state is untouched by an outage: a read is simply late, a
completion is re-sent as is (the completion script's call guard and ledger make it idempotent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from schemas import WorkerKeys
from schemas.direct import Direct, serving
from schemas.retry import OutageListener, OutageRider, RetryPolicy, transient

from ..config import TransportSettings
from ..lua import script_source
from .errors import LeaseHeld, LeaseLost, NotDurable, Stopping
from .unblock import InFlight

__all__ = ["Direct", "LeaseHeld", "LeaseLost", "NotDurable", "RedisIO", "Stopping"]

T = TypeVar("T")
log = logging.getLogger("dgr.transport")


class RedisIO:
    """The client and everything the transport's parts share. Not thread-safe: one thread at a time."""

    SCRIPTS = ("complete", "pending", "recover", "acquire", "renew", "release")

    def __init__(self, client: redis.Redis, worker_id: str, consumer_name: str,
                 settings: TransportSettings, listener: OutageListener | None = None) -> None:
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisTransport needs a client with decode_responses=False")
        self.client = client
        self.worker_id = worker_id
        self.consumer_name = consumer_name
        self.settings = settings
        self.keys = WorkerKeys(worker_id)
        self.round_trips = 0  # requests sent to Redis (a pipeline or a script counts as one)
        # requests that failed and were tried again (`io`): a request that failed may have run, its reply lost
        self.retries = 0
        self.stop = threading.Event()  # set by the worker on SIGTERM (request_stop): outage waits end at once
        self.listener = listener
        self.in_flight = InFlight(lambda: self.client, f"worker {worker_id}")
        self._stopped_unreachable = False
        self._rider = OutageRider(RetryPolicy(settings.outage_max_s, settings.retry_base_s, settings.retry_cap_s),
                                  log, f"worker {worker_id}", listener)
        self.scripts: dict[str, Any] = {name: client.register_script(script_source(name)) for name in self.SCRIPTS}
        # the hot requests (the read ahead, the scripts) on a kept connection (a redis.Redis's only: Direct.of)
        self._direct = Direct.of(client)

    @property
    def outages(self) -> int:
        """Redis outages ridden through (unavailable, then back)."""
        return self._rider.outages

    def request_stop(self) -> None:
        """End every wait at once (`Stopping`), and cut off a request that hangs past the grace (unblock.py)."""
        self.stop.set()
        self.in_flight.stop_requested()

    def io(self, fn: Callable[[], T]) -> T:
        """fn(), retried through a Redis outage (module docstring); fn must be idempotent."""
        rider = self._rider
        started = self.in_flight.started
        me = threading.get_ident()
        if self._stopped_unreachable:  # a stop met Redis unreachable once: no request waits on it again
            raise Stopping(f"worker {self.worker_id}: stop requested while Redis was unreachable")
        while True:
            started[me] = time.monotonic()
            try:
                out = fn()
            except Exception as e:
                started.pop(me, None)
                if not (transient(e) or isinstance(e, NotDurable)):  # too few replicas: as Redis not serving
                    raise
                self.retries += 1
                delay = rider.backoff(e)  # re-raises e once the outage is older than outage_max_s
                if self.stop.wait(delay):
                    self._stopped_unreachable = True
                    raise Stopping(f"worker {self.worker_id}: stop requested while Redis was unreachable") from e
                continue
            except BaseException:
                started.pop(me, None)
                raise
            started.pop(me, None)
            rider.succeeded()
            return out

    def direct(self) -> Direct | None:
        """The kept connection's sender (Direct) for the client in use, or None: a cluster client, or another
        client put in the transport's place (tests put a flaky one there)."""
        return serving(self._direct, self.client)

    def script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a registered script (EVALSHA, loading it if Redis lost it), through an outage."""
        self.round_trips += 1
        script = self.scripts[name]
        direct = self.direct()
        if direct is None or not isinstance(script, Script):
            return self.io(lambda: script(keys=keys, args=args))

        def run() -> Any:
            (got,) = direct(("EVALSHA", script.sha, len(keys), *keys, *args))
            if isinstance(got, NoScriptError):  # Redis lost its scripts (a restart): loaded again, as Script does
                script.sha = self.client.script_load(script.script)
                (got,) = direct(("EVALSHA", script.sha, len(keys), *keys, *args))
            if isinstance(got, Exception):
                raise got
            return got

        return self.io(run)

    def load_scripts(self) -> None:
        """Load every script (after a restart Redis has none), so the next call is one EVALSHA."""
        for script in self.scripts.values():
            self.client.script_load(script.script)
