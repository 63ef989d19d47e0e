"""One live consumer per worker id: the lease (`dgr:{W}:lease`, SET NX PX through a script that also
bumps `dgr:{W}:lease:epoch`). A second consumer waits as a standby; a process that lost the lease to
another (paused, partitioned) is fenced: every completion checks the lease in the same script
(lease.lua) and a fenced process writes nothing (`LeaseLost`)."""

from __future__ import annotations

import logging
import os
import socket
import uuid

from .connection import LeaseHeld, LeaseLost, RedisIO, Stopping

__all__ = ["Lease"]

log = logging.getLogger("dgr.transport")


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _pid_gone(pid: int) -> bool:
    """The process is gone (or a zombie waiting to be reaped) on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


class Lease:
    def __init__(self, io: RedisIO) -> None:
        self.io = io
        self.instance_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.token: str | None = None
        self.epoch = ""

    def acquire(self, *, wait: bool = True) -> str:
        """Take this worker id's lease. Held by a live process: wait=True polls as a standby (one log
        line) until it is free, or until a stop is requested (`Stopping`); wait=False raises LeaseHeld.
        A holder on this host whose process is gone (kill -9, then a restart) is replaced at once rather
        than after the lease lapses."""
        io, st = self.io, self.io.settings
        keys = [io.keys.lease, io.keys.lease_epoch]
        steal = ""
        waiting_logged = False
        while True:
            ok, value = io.script("acquire", keys, [self.instance_id, st.lease_ms, steal])
            value = _s(value)
            if int(ok) == 1:
                self.token = value
                self.epoch = value.split(":", 1)[0]
                log.info("lease acquired", extra={"worker": io.worker_id, "lease": value, "replaced": steal or None})
                return value
            if self._holder_gone(value):
                steal = value
                continue
            steal = ""
            if not wait:
                raise LeaseHeld(value)
            if not waiting_logged:
                log.warning("another consumer holds this worker id: waiting as standby", extra={
                    "worker": io.worker_id, "holder": value, "lease_ms": st.lease_ms})
                waiting_logged = True
            if io.stop.wait(min(1.0, st.lease_ms / 4000)):
                raise Stopping(f"worker {io.worker_id}: stop requested while waiting as a standby")

    @staticmethod
    def _holder_gone(token: str) -> bool:
        parts = token.split(":")
        if len(parts) != 4 or parts[1] != socket.gethostname() or not parts[2].isdigit():
            return False
        pid = int(parts[2])
        # Our own pid under another token: a container restarted with the same pid.
        return pid == os.getpid() or _pid_gone(pid)

    def renew(self) -> None:
        """Extend the lease (taking it back if it lapsed and nobody took it). LeaseLost if another did."""
        if self.token is None:
            return
        io = self.io
        got = int(io.script("renew", [io.keys.lease, io.keys.lease_epoch], [self.token, self.epoch,
                                                                             io.settings.lease_ms]))
        if got == 0:
            raise LeaseLost(f"worker {io.worker_id}: the lease was taken over by another consumer")
        if got == 2:
            log.warning("lease had lapsed (a pause or an outage longer than the lease); nobody took it: "
                        "taken back", extra={"worker": io.worker_id, "lease": self.token})

    def release(self) -> None:
        """Give the lease back (clean exit), if still ours."""
        if self.token is None:
            return
        token, self.token = self.token, None
        self.io.script("release", [self.io.keys.lease], [token])
