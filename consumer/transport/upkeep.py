"""A worker's upkeep in Redis: registration (groups, the advertisement, scripts), the heartbeat, input
lag, trimming, and the two questions the worker asks before admitting steps of sessions it does not
hold (answered already? cancelled?), plus the input activations of route hops."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from schemas import GROUP, WIRE_VERSION, CompatibilityKey, StepJob
from schemas.accounting import parse_tally
from schemas.heartbeat import spec_version
from schemas.keys import WORKERS_INDEX
from schemas.lag import stream_lag
from schemas.prefix import PrefixSummary
from schemas.replies import as_str

from .connection import RedisIO
from .errors import EvictingRedis
from .intake import Intake
from .memory import evicting, eviction_policies

log = logging.getLogger("dgr.transport")

__all__ = ["Upkeep"]


def _att_pub(raw: Any) -> tuple[int, int] | None:
    """(attempt, position) of the last ok answer published, from a tally value or a session hash's
    (att, pub) fields; None when there is none."""
    if raw is None:
        return None
    if isinstance(raw, list | tuple):
        if raw[0] is None or raw[1] is None:
            return None
        return int(raw[0]), int(raw[1])
    t = parse_tally(raw)
    return None if t is None else (int(t["att"]), int(t["pub"]))


class Upkeep:
    def __init__(self, io: RedisIO, intake: Intake) -> None:
        self.io = io
        self.intake = intake
        # What the last input_lag() read (its round trip asks for the drain key too): the next heartbeat
        # advertises both, for placement (docs/placement.md) and `dgr inspect`.
        self.draining = False
        self.queued = 0
        self.summary_version: str | None = None  # of the prefix summary last written (None: write it)
        self.spec_version: str | None = None  # of the advertisement last written (schemas/heartbeat.py spec_version)

    def check_memory(self, *, running: bool = False) -> None:
        """Refuse (EvictingRedis) a Redis that may evict dgr's keys at its maxmemory (transport/memory.py), unless
        the settings allow it: then say so. `running`: the look after an outage (a failover may have promoted a
        server configured otherwise): an error in the log, the worker goes on (its sessions are in flight)."""
        io = self.io
        problem = evicting(io.io(lambda: eviction_policies(io.client)))
        if problem is None:
            return
        if running:
            log.error("%s (seen after a Redis outage)", problem, extra={"worker": io.worker_id})
        elif not io.settings.allow_eviction:
            raise EvictingRedis(problem)
        else:
            log.warning("%s; starting anyway (--allow-eviction)", problem, extra={"worker": io.worker_id})

    def register(self, keys: Sequence[CompatibilityKey], info: Mapping[str, object]) -> list[str]:
        """Create the consumer group on every key's input stream (id 0, MKSTREAM; BUSYGROUP ignored),
        advertise the keys and `info` (with the wire version) at `keys.spec` (JSON), SADD the worker to
        WORKERS_INDEX, load the scripts. Returns the stream names. Idempotent."""
        io = self.io
        if self.spec_version is not None and not io.settings.allow_eviction:  # registered before: after an outage
            self.check_memory(running=True)
        streams = list(dict.fromkeys(io.keys.input_stream(k.digest, k.phase) for k in keys))
        for s in streams:
            self.intake.stream_meta(s)
        self.intake.create_groups(streams)
        spec = {"worker_id": io.worker_id, "keys": [k.model_dump(mode="json") for k in keys], "streams": streams,
                "info": {**info, "wire_version": WIRE_VERSION}, "registered_at": time.time()}
        body = json.dumps(spec, default=str, separators=(",", ":"))
        self.spec_version = spec_version(body)  # each heartbeat names it: a Tracker reads the spec when it changes

        def advertise() -> None:
            pipe = io.client.pipeline(transaction=False)
            pipe.set(io.keys.spec, body)
            pipe.sadd(WORKERS_INDEX, io.worker_id)
            pipe.execute()
            io.load_scripts()

        io.io(advertise)
        self.intake.add_streams(streams)
        return streams

    def heartbeat(self, info: Mapping[str, object] | None = None, summary: PrefixSummary | None = None) -> None:
        """SET keys.heartbeat to {ts, ttl_s, worker_id, consumer, **info} (JSON), EX heartbeat_ttl_s (`ttl_s`: a
        reader takes the beat's age from the key's PTTL, on Redis' clock, not from `ts` on this host's: schemas/
        heartbeat.py). The prefix
        `summary` (its ids) goes to keys.prefix_summary, written only when it changed and kept alive with the
        heartbeat; the heartbeat's `prefix` names its version (`PrefixSummary.ref`)."""
        io = self.io
        ttl = io.settings.heartbeat_ttl_s
        body = {"ts": time.time(), "ttl_s": ttl, "worker_id": io.worker_id, "consumer": io.consumer_name,
                "draining": self.draining, "queued": self.queued, **(info or {})}
        if self.spec_version is not None:
            body["spec"] = self.spec_version
        ref = summary.ref() if summary is not None else None
        if ref is not None:
            body["prefix"] = ref
        raw = json.dumps(body, default=str, separators=(",", ":"))
        if summary is None or ref is None:
            def plain() -> None:
                pipe = io.client.pipeline(transaction=False)
                pipe.set(io.keys.heartbeat, raw, ex=ttl)
                pipe.sadd(WORKERS_INDEX, io.worker_id)  # back in the index if `dgr ops forget-gone` took it out
                pipe.execute()

            io.io(plain)
            return
        version = str(ref["version"])
        doc = json.dumps({**summary.as_json(), "version": version}, separators=(",", ":"))
        write = version != self.summary_version

        def beat() -> bool:
            pipe = io.client.pipeline(transaction=False)
            if write:  # before the heartbeat that names it: a Tracker never reads a version not yet written
                pipe.set(io.keys.prefix_summary, doc, ex=ttl)
            else:
                pipe.expire(io.keys.prefix_summary, ttl)
            pipe.set(io.keys.heartbeat, raw, ex=ttl)
            pipe.sadd(WORKERS_INDEX, io.worker_id)
            return bool(pipe.execute()[0])

        if not io.io(beat):  # Redis lost the key (EXPIRE answered 0): written again now, not a beat later
            io.io(lambda: io.client.set(io.keys.prefix_summary, doc, ex=ttl))
        self.summary_version = version

    def checks(self, steps: Sequence[StepJob], session_ids: Sequence[str]) -> tuple[set[str], set[str]]:
        """(the job ids of the steps already answered, the session ids with a cancel marker), in one
        round trip. The worker asks this for the steps of sessions it does not hold, before admitting
        them: a session's cancel recorded while the worker was down or before its first job was read
        wins, and a step answered by an earlier process (re-pushed by a Tracker that had not read the
        answer when Redis went away) is neither answered again (`state_lost` under the same job id)
        nor, when it is an opening, opens a ghost session. Answered: its session's last ok answer
        published is at or past the step's last result position (the tally, or the session hash once
        closed: docs/accounting.md), or at or past its first one when the session is closed and not open
        again (a continuation that finished early; not when it was closed cancelled), or it was answered not
        ok (its `res:` marker: the job id's, or the ending answer's of a continuation job)."""
        if not steps and not session_ids:
            return set(), set()
        io, keys = self.io, self.io.keys
        jobs, sids = list(steps), list(session_ids)

        def ask() -> list[Any]:
            pipe = io.client.pipeline(transaction=False)
            for j in jobs:
                pipe.hget(keys.tally, j.session_id)
                pipe.hmget(keys.session_account(j.session_id), "att", "pub", "closed")
                # a continuation job's ending answer (not ok) is filed under its own result id (StepJob.answer_id)
                pipe.exists(*dict.fromkeys((keys.result_record(j.job_id),
                                            keys.result_record(j.answer_id(0, ok=False)))))
            for sid in sids:
                pipe.exists(keys.cancel_marker(sid))
            return pipe.execute()

        io.round_trips += 1
        replies = io.io(ask)
        answered: set[str] = set()
        for i, j in enumerate(jobs):
            led, hashed, marker = replies[3 * i: 3 * i + 3]
            last = _att_pub(led) or _att_pub(hashed[:2])
            first = j.start_position + 1 if j.phase == "decode" else j.end_position  # its first result's position
            # A session closed `cancelled` is not taken for a continuation that finished early: a cancel of a
            # session no process held (its worker died mid-continuation) closes it with no answer to the
            # Tracker, which still waits on this step; answered CANCELLED (its marker), it learns of the cancel.
            # When the process that held it answered the cancel, that answer left the step's `res:` marker.
            closed_early = led is None and hashed[2] is not None and hashed[2] != b"cancelled"
            if int(marker) or (last is not None and (last >= (j.attempt, j.end_position)
                                                     or (closed_early and last >= (j.attempt, first)))):
                answered.add(j.job_id)
        cancelled = {sid for sid, r in zip(sids, replies[3 * len(jobs):], strict=True) if int(r)}
        return answered, cancelled

    def fetch_activations(self, blobs: Sequence[str]) -> list[bytes | None]:
        """The bytes of each input activations blob (None: missing, or not a key of this worker's
        activations), in ONE round trip (MGET: every key is in this worker's hash tag)."""
        io = self.io
        own = [b for b in dict.fromkeys(blobs) if b.startswith(io.keys.base + ":act:in:")]
        if not own:
            return [None] * len(blobs)
        io.round_trips += 1
        got: Any = io.io(lambda: io.client.mget(own))
        by_key = dict(zip(own, got, strict=True))
        return [by_key.get(b) for b in blobs]

    def input_lag(self) -> dict[str, dict[str, int]]:
        """Per registered stream: length, lag (XINFO GROUPS 'lag'; the length where Redis cannot
        tell), pending. One round trip, which also reads the drain key (`draining`, `queued`)."""
        io, streams = self.io, list(self.intake.streams)

        def ask() -> list[Any]:
            pipe = io.client.pipeline(transaction=False)
            for s in streams:
                pipe.xlen(s)
                pipe.xinfo_groups(s)
            pipe.exists(io.keys.drain)
            return pipe.execute(raise_on_error=False)

        replies = io.io(ask)
        drain = replies[-1]
        if not isinstance(drain, Exception):
            self.draining = bool(drain)
        out: dict[str, dict[str, int]] = {}
        for i, s in enumerate(streams):
            sl = stream_lag(replies[2 * i], replies[2 * i + 1])
            pending = int(sl.group.get("pending") or 0) if sl.group is not None else 0
            out[s] = {"length": sl.length, "lag": sl.behind, "pending": pending}
        self.queued = sum(v["lag"] for v in out.values())
        return out

    def trim(self) -> None:
        """Drop what no consumer needs any more, so hostile or merely old entries cannot pile up:
        input entries the group has delivered and acked (XTRIM MINID ~ below the oldest pending
        entry, or just past the last delivered one; only while `dgr-workers` is the stream's only
        group, since another group's reader would lose entries), and cancellations beyond
        cancel_maxlen (writers other than the producer may not trim). Two round trips."""
        io, streams = self.io, list(self.intake.streams)
        if not streams:
            return

        def ask() -> list[Any]:
            pipe = io.client.pipeline(transaction=False)
            for s in streams:
                pipe.xinfo_groups(s)
                pipe.xpending(s, GROUP)
            return pipe.execute(raise_on_error=False)

        replies = io.io(ask)

        def cut() -> None:
            pipe = io.client.pipeline(transaction=False)
            for i, s in enumerate(streams):
                upto = _trim_point(replies[2 * i], replies[2 * i + 1])
                if upto is not None:
                    pipe.xtrim(s, minid=upto, approximate=True)
            pipe.xtrim(io.keys.cancellations, maxlen=io.settings.cancel_maxlen, approximate=True)
            pipe.execute(raise_on_error=False)

        io.io(cut)  # a trim is idempotent: re-sent as is after a reconnect
        io.round_trips += 2


def _trim_point(groups: Any, pending: Any) -> str | None:
    """The MINID below which every entry of an input stream is delivered and acked, or None."""
    if isinstance(groups, Exception) or isinstance(pending, Exception) or len(groups) != 1:
        return None
    g = groups[0]
    if as_str(g.get("name", b"")) != GROUP:
        return None
    if int(pending.get("pending") or 0) > 0 and pending.get("min"):
        return as_str(pending["min"])
    ms, _, seq = as_str(g.get("last-delivered-id") or b"0-0").partition("-")
    return f"{ms}-{int(seq or 0) + 1}"
