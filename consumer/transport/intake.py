"""Reading a worker's input: step jobs from its input streams (consumer group `dgr-workers`) and
cancellations from its cancel stream, each entry decoded once, strictly, into a job or a refusal.

Delivery is at least once: an entry stays in this consumer's pending list until a completion acks it.
Pending re-read (what the worker author must know): the first reads after a transport is made re-read
this consumer's own pending entries (XREADGROUP id `0`, then the last id seen) before any new entry,
until each stream's pending list is drained; only then do reads switch to `>`. Entries already
delivered more than `max_deliveries` times are dead-lettered on the way (`too_many_deliveries`)
instead of being handed out again, so a poison entry that crashes the worker cannot crash it forever;
such an entry is still returned once, with `given_up` set, so that the worker answers its session.
A pending entry whose stream entry was trimmed comes back with empty fields (answered as a malformed
dead letter).

A blocked read returns as soon as one entry arrives; a short, bounded gather of non-blocking reads
follows while `more` says the batch is not full yet.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from schemas import GROUP, Phase, Reason, Signer, WireError, parse_input_stream
from schemas.direct import stream_pairs, xread_command
from schemas.replies import as_str, entry_fields, flat_pairs, stream_entries
from schemas.retry import transient
from schemas.wire import cancel_from_fields, job_from_fields

from .connection import RedisIO
from .protocol import DeadLetter, Delivery, Inbound, Refusal
from .unblock import READ_SLICE_MS

__all__ = ["MAX_DEAD_LETTER_FIELDS", "Intake", "no_group"]

log = logging.getLogger("dgr.transport")

MAX_DEAD_LETTER_FIELDS = 64  # original fields copied into a dead letter (a malformed entry may have many)


def no_group(e: redis.ResponseError) -> bool:
    """The stream or its group is gone."""
    return "NOGROUP" in str(e)


class Intake:
    """The registered input streams, what was handed out, and the reads. One thread at a time."""

    def __init__(self, io: RedisIO, signer: Signer | None) -> None:
        self.io = io
        self.signer = signer  # set: every input and cancel entry must carry a valid HMAC (schemas/signing.py)
        self.streams: list[str] = []  # registered input streams
        self.meta: dict[str, tuple[str, Phase]] = {}  # stream -> (digest, phase)
        self.by_phase: dict[Phase, str] = {}  # phase -> the registered input stream of that phase
        self.cursor: dict[str, str] = {}  # stream -> last own pending id re-read
        self.drained: set[str] = set()
        self.recovered: dict[str, set[str]] = {}  # ids recovery handed out, while not drained
        # Entries handed out (read, recovered) and not yet acked by a completion, per stream: what the
        # worker holds. Recovery re-delivers own pending entries that are not in here.
        self.outstanding: dict[str, set[str]] = {}
        self.newest: dict[str, str] = {}  # stream -> the last entry id a '>' read took (`unreplied` looks past it)
        self._cancel_cursor = "0-0"
        # Entries the pending re-read dead-lettered (already in the dead-letter stream and acked): for
        # logs and metrics; the newest 1000 are kept, clear it freely.
        self.dead_lettered: deque[DeadLetter] = deque(maxlen=1000)

    # ---------------------------------------------------------------- streams and deliveries

    def add_streams(self, streams: Sequence[str]) -> None:
        for s in streams:
            self.stream_meta(s)
            if s not in self.streams:
                self.streams.append(s)
            self.by_phase[self.meta[s][1]] = s

    def stream_meta(self, stream: str) -> tuple[str, Phase]:
        m = self.meta.get(stream)
        if m is None:
            parsed = parse_input_stream(stream)
            if parsed is None or parsed[0] != self.io.worker_id:
                raise ValueError(f"{stream!r} is not an input stream of worker {self.io.worker_id!r}")
            m = self.meta[stream] = (parsed[1], parsed[2])
        return m

    def delivery(self, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes], *,
                 held: bool = True, given_up: str = "") -> Delivery:
        """held: handed to the worker, which will pass it back to a completion (False: already acked)."""
        digest, phase = self.meta[stream]
        eid = as_str(entry_id)
        if held:
            self.outstanding.setdefault(stream, set()).add(eid)
        return Delivery(stream=stream, entry_id=eid, fields=fields, digest=digest, phase=phase, given_up=given_up)

    def settled(self, deliveries: Sequence[Delivery]) -> None:
        """These deliveries were acked (or dead-lettered): the worker no longer holds them."""
        for d in deliveries:
            held = self.outstanding.get(d.stream)
            if held is not None:
                held.discard(d.entry_id)

    def create_groups(self, streams: Sequence[str] | Mapping[str, Any]) -> None:
        names = list(streams)
        client = self.io.client

        def create() -> None:
            pipe = client.pipeline(transaction=False)
            for s in names:
                pipe.xgroup_create(s, GROUP, id="0", mkstream=True)
            for r in pipe.execute(raise_on_error=False):
                if isinstance(r, Exception) and "BUSYGROUP" not in str(r):
                    raise r

        self.io.io(create)

    # ---------------------------------------------------------------- decoding

    def inbound(self, d: Delivery) -> Inbound:
        """Decode one entry: its HMAC checked first when a signer is set (a forged entry is never
        answered: the answer would go to whichever session the forger named), then the strict wire
        parse. Never raises: whatever its bytes, an entry becomes a job or a refusal."""
        name = f"{d.phase}.{d.entry_id}"
        try:
            if self.signer is not None and not self.signer.verify(d.stream, d.fields):
                return Inbound(d, d.phase, d.digest, name, None, Refusal(Reason.BAD_SIGNATURE, "missing or wrong HMAC"))
            return Inbound(d, d.phase, d.digest, name, job_from_fields(d.fields))
        except WireError as e:
            return Inbound(d, d.phase, d.digest, name, None,
                           Refusal(e.reason, str(e), e.session_id, e.job_id, e.reply_to))
        except Exception as e:
            log.warning("entry refused by the per-entry guard", exc_info=True,
                        extra={"stream": d.stream, "entry_id": d.entry_id})
            return Inbound(d, d.phase, d.digest, name, None,
                           Refusal(Reason.MALFORMED, f"unexpected {type(e).__name__}: {e}"[:200]))

    # ---------------------------------------------------------------- reading

    def read(self, want: Mapping[Phase, int], *, block_ms: int | None = None, gather_ms: float | None = None,
             more: Callable[[Mapping[Phase, int]], bool] | None = None) -> list[Inbound]:
        """Up to want[phase] entries of each registered phase's stream, each decoded."""
        counts = {self.by_phase[p]: n for p, n in want.items() if n > 0 and p in self.by_phase}
        if not counts:
            return []

        def gather(ds: list[Delivery]) -> bool:
            assert more is not None
            by_phase: dict[Phase, int] = {}
            for d in ds:
                by_phase[d.phase] = by_phase.get(d.phase, 0) + 1
            return more(by_phase)

        got = self.read_streams(counts, block_ms=block_ms, gather_ms=gather_ms,
                                more=gather if more is not None else None)
        return [self.inbound(d) for d in got]

    def read_streams(self, want: Mapping[str, int], *, block_ms: int | None = None, gather_ms: float | None = None,
                     more: Callable[[list[Delivery]], bool] | None = None) -> list[Delivery]:
        """Up to want[stream] entries of each stream (streams with count 0 are not read).

        1. This consumer's own pending entries not yet re-read (after start, once, until drained).
        2. New entries ('>'): one multi-stream XREADGROUP, with BLOCK block_ms when step 1 had
           nothing (block_ms <= 0: do not block).
        3. After a wake-up (something was had), a gather loop of non-blocking reads while
           `more(deliveries_so_far)` (default: some stream still under its count) and gather_ms
           has not passed; every stream stays capped at its count.
        4. When a read failed and was tried again, the entries a lost reply carried, first (`unreplied`).
        """
        retries, newest = self.io.retries, dict(self.newest)
        got = self._read_streams(want, block_ms, gather_ms, more)
        return got if self.io.retries == retries else self.unreplied(got, newest)

    def unreplied(self, got: list[Delivery], newest: Mapping[str, str]) -> list[Delivery]:
        """`got` after the entries of a read whose reply was lost. A request that fails (a reset, a restart, a
        failover) is tried again (`RedisIO.io`); an XREADGROUP `>` that ran and lost its reply leaves its entries
        delivered to this consumer, pending and unheld, and the next try reads the ones after them. Handed out by
        the next ownership sweep (recovery.py), after those, a session's later step would come before its earlier
        one: a continuation pushed ahead refused position_gap, a prompt's later chunk answered state_lost
        (tests/test_lost_replies.py). So they are handed out here, before what the read got: they are older. A
        stream whose own pending entries are still being re-read (after a start) hands them out anyway. Looked for
        past `newest` (each stream's last entry id taken before the read): the lost entries are newer than every
        entry the worker holds, however many it holds."""
        lost = [d for s in self.streams if s in self.drained for d in self.unheld_pending(s, newest.get(s))]
        return lost + got if lost else got

    def unheld_pending(self, stream: str, after: str | None = None) -> list[Delivery]:
        """Own pending entries of `stream` (after the entry id `after`, if given) that the worker does not hold (a
        read whose reply was lost; a fenced predecessor's read under the same consumer name), claimed and handed
        out again."""
        io = self.io
        held = self.outstanding.get(stream, set())
        io.round_trips += 1
        start = "-" if after is None else "(" + after
        pending: Any = io.io(lambda: io.client.xpending_range(stream, GROUP, start, "+", io.settings.claim_count,
                                                              consumername=io.consumer_name))
        ids: list[Any] = [as_str(p["message_id"]) for p in pending if as_str(p["message_id"]) not in held]
        if not ids:
            return []
        io.round_trips += 1
        claimed: Any = io.io(lambda: io.client.xclaim(stream, GROUP, io.consumer_name, 0, ids))
        out = [self.delivery(stream, entry[0], entry_fields(entry[1])) for entry in claimed
               if entry and entry[0] is not None]
        if out:
            log.warning("own pending entries the worker did not hold: handed out again", extra={
                "worker": io.worker_id, "stream": stream, "entries": len(out)})
        return out

    def _read_streams(self, want: Mapping[str, int], block_ms: int | None, gather_ms: float | None,
                      more: Callable[[list[Delivery]], bool] | None) -> list[Delivery]:
        st = self.io.settings
        block = st.block_ms if block_ms is None else block_ms
        gather = st.gather_ms if gather_ms is None else gather_ms
        remaining = self._counts(want)
        if not remaining:
            return []
        out: list[Delivery] = []
        undrained = [s for s in remaining if s not in self.drained]
        if undrained:
            out += self._read_pending(undrained, remaining)
        if any(n > 0 for n in remaining.values()):
            out += self._read_new(remaining, block=0 if out else block)
        if not out or gather <= 0:
            return out
        deadline = time.monotonic() + gather / 1000.0
        pause = gather / 4000.0
        while any(n > 0 for n in remaining.values()) and (more is None or more(out)):
            now = time.monotonic()
            if now >= deadline or self.io.stop.is_set():
                break
            got = self._read_new(remaining, block=0)
            if got:
                out += got
            else:
                time.sleep(min(pause, deadline - now))
        return out

    def _counts(self, want: Mapping[str, int]) -> dict[str, int]:
        """The positive counts of `want` by stream name as text, each stream checked to be this worker's."""
        counts: dict[str, int] = {}
        for stream, n in want.items():
            if n > 0:
                s = as_str(stream)
                self.stream_meta(s)
                counts[s] = counts.get(s, 0) + n
        return counts

    def _read_pending(self, streams: list[str], remaining: dict[str, int]) -> list[Delivery]:
        st = self.io.settings
        args: list[str | int] = [GROUP, self.io.consumer_name, st.max_deliveries, st.dlq_maxlen, MAX_DEAD_LETTER_FIELDS]
        asked = {s: remaining[s] for s in streams}
        for s in streams:
            args += [self.cursor.get(s, "0"), asked[s]]
        reply = self.call_script("pending", [self.io.keys.dead_letters, *streams], args, streams)
        out: list[Delivery] = []
        for s, (kept, dead, scanned, last) in zip(streams, reply, strict=True):
            skip = self.recovered.get(s, set())
            for entry_id, flat in kept:
                d = self.delivery(s, entry_id, flat_pairs(flat))
                if d.entry_id not in skip:
                    out.append(d)
                    remaining[s] -= 1
            for entry_id, n, flat in dead:
                why = f"delivered {as_str(n)} times (max {st.max_deliveries})"
                d = self.delivery(s, entry_id, flat_pairs(flat), held=False, given_up=why)
                self.dead_lettered.append(DeadLetter(d, Reason.TOO_MANY_DELIVERIES, why))
                out.append(d)  # its session is answered (not counted against the read's count)
            if int(scanned) < asked[s]:
                self.drained.add(s)
                self.cursor.pop(s, None)
                self.recovered.pop(s, None)
            else:
                self.cursor[s] = as_str(last)
        return out

    def _read_new(self, remaining: dict[str, int], *, block: int) -> list[Delivery]:
        """'>' reads of every stream still under its count, capped at that count. One round trip
        when nothing blocks; when all counts are equal, one command even when blocking."""
        fresh = {s: n for s, n in remaining.items() if n > 0}
        if not fresh:
            return []
        by_count = _by_count(fresh)
        self.io.round_trips += 1
        if len(by_count) == 1:
            ((count, ids),) = by_count.items()
            resp = self._xreadgroup(ids, count, block if block > 0 else None)
            return self._take(resp, remaining)
        out = self._take_replies(self._pipelined(by_count, cancels=False), remaining, list(fresh))
        if out or block <= 0:
            return out
        # Nothing waiting: block on all of them with the smallest count (never over any cap).
        resp = self._xreadgroup({s: ">" for s in fresh}, min(fresh.values()), block)
        return self._take(resp, remaining)

    def _take_replies(self, replies: list[Any], remaining: dict[str, int], read: Sequence[str]) -> list[Delivery]:
        """The entries of a pipeline of XREADGROUPs of the streams `read`: the replies that worked count (their
        entries were taken); a stream or group gone is made again (its entries are read next time)."""
        out: list[Delivery] = []
        lost_group = False
        for resp in replies:
            if isinstance(resp, redis.ResponseError) and no_group(resp):
                lost_group = True
            elif isinstance(resp, Exception):
                raise resp
            else:
                out += self._take(resp, remaining)
        if lost_group:
            self.create_groups(read)
        return out

    def _xreadgroup(self, ids: dict[str, str], count: int, block: int | None) -> Any:
        """One XREADGROUP; a BLOCK longer than READ_SLICE_MS is served in slices, so that a stop is seen
        between them (the loop stops within a slice, however long block_ms is)."""
        io = self.io
        if block is None or block <= READ_SLICE_MS:
            return self._xreadgroup_once(ids, count, block)
        deadline = time.monotonic() + block / 1000.0
        while True:
            left_ms = int(1000 * (deadline - time.monotonic()))
            resp = self._xreadgroup_once(ids, count, max(1, min(READ_SLICE_MS, left_ms)))
            if resp or left_ms <= READ_SLICE_MS or io.stop.is_set():
                return resp
            io.round_trips += 1

    def _xreadgroup_once(self, ids: dict[str, str], count: int, block: int | None) -> Any:
        client, name = self.io.client, self.io.consumer_name
        try:
            return self.io.io(lambda: client.xreadgroup(GROUP, name, ids, count=count, block=block))  # type: ignore[arg-type]
        except redis.ResponseError as e:
            if not no_group(e):
                raise
            # The stream or the group is gone (FLUSHALL, DEL, a Redis restarted without its data): recreate.
            self.create_groups(ids)
            return self.io.io(lambda: client.xreadgroup(GROUP, name, ids, count=count, block=None))  # type: ignore[arg-type]

    def _take(self, resp: Any, remaining: dict[str, int]) -> list[Delivery]:
        out: list[Delivery] = []
        for name, entries in stream_entries(resp):
            s = as_str(name)  # decoded once per stream per reply
            for entry_id, fields in entries:
                out.append(self.delivery(s, entry_id, entry_fields(fields)))
            remaining[s] -= len(entries)
            if entries:
                self.newest[s] = out[-1].entry_id
        return out

    def call_script(self, name: str, keys: list[str], args: list[Any], streams: Sequence[str]) -> Any:
        """A script over input streams: the groups are made again if Redis lost them."""
        try:
            return self.io.script(name, keys, args)
        except redis.ResponseError as e:
            if not no_group(e):
                raise
            self.create_groups(streams)
            return self.io.script(name, keys, args)

    # ---------------------------------------------------------------- cancellations

    def cancellations(self) -> tuple[list[str], list[DeadLetter]]:
        """Session ids cancelled since the last call (one non-blocking XREAD of the cancel stream), and
        the entries that are not cancellations (undecodable, unsigned) as dead letters. The first call
        reads from the beginning of the (MAXLEN-trimmed) stream."""
        io = self.io
        stream = io.keys.cancellations
        io.round_trips += 1
        return self._take_cancellations(
            io.io(lambda: io.client.xread({stream: self._cancel_cursor}, count=io.settings.cancel_count)))

    def read_ahead(self, want: Mapping[str, int]) -> tuple[list[Delivery], list[str], list[DeadLetter]]:
        """`read_streams(want, block_ms=0, gather_ms=0)` and `cancellations()` in one round trip (a pipeline of
        the cancel stream's XREAD and the input streams' XREADGROUPs): what the worker reads ahead while the
        engine computes, every call. A round trip is most of a read's CPU here (a PING through redis-py
        about 160 us of CPU on this host, 55 us of it the socket's system calls), and the two were one after
        the other on the I/O thread. Before every stream's own pending entries are re-read (after a start),
        the two reads as before."""
        counts = self._counts(want)
        if not counts or any(s not in self.drained for s in counts):
            got = self.read_streams(counts, block_ms=0, gather_ms=0) if counts else []
            cancels, refused = self.cancellations()
            return got, cancels, refused
        self.io.round_trips += 1
        retries, newest = self.io.retries, dict(self.newest)
        cancel_reply, *replies = self._pipelined(_by_count(counts), cancels=True)
        if isinstance(cancel_reply, Exception):
            # raised before the read's entries are taken as held: they stay this consumer's pending entries,
            # which recovery hands out again (taken, they would be held by no one)
            raise cancel_reply
        got = self._take_replies(replies, counts, list(counts))
        if self.io.retries != retries:
            got = self.unreplied(got, newest)
        cancels, refused = self._take_cancellations(cancel_reply)
        return got, cancels, refused

    def _pipelined(self, by_count: Mapping[int, dict[str, str]], *, cancels: bool) -> list[Any]:
        """One pipeline of an XREADGROUP per count (non-blocking), after the cancel stream's XREAD (`cancels`): the
        replies, each an exception where its command failed; a transient one is raised, so it is ridden through."""
        io = self.io
        client, name, direct = io.client, io.consumer_name, io.direct()

        def read_all() -> list[Any]:
            if direct is not None:  # the same commands on the kept connection, their raw replies
                cmds = [xread_command({io.keys.cancellations: self._cancel_cursor}, io.settings.cancel_count)
                        ] if cancels else []
                cmds += [xread_command(ids, count, group=(GROUP, name)) for count, ids in by_count.items()]
                replies = [r if isinstance(r, Exception) else stream_pairs(r) for r in direct(*cmds)]
            else:
                pipe = client.pipeline(transaction=False)
                if cancels:
                    pipe.xread({io.keys.cancellations: self._cancel_cursor}, count=io.settings.cancel_count)
                for count, ids in by_count.items():
                    pipe.xreadgroup(GROUP, name, ids, count=count)  # type: ignore[arg-type]
                replies = pipe.execute(raise_on_error=False)
            for r in replies:
                if isinstance(r, Exception) and transient(r):
                    raise r
            return replies

        return io.io(read_all)

    def _take_cancellations(self, resp: Any) -> tuple[list[str], list[DeadLetter]]:
        stream = self.io.keys.cancellations
        out: list[str] = []
        dead: list[DeadLetter] = []
        for _name, entries in stream_entries(resp):
            for entry_id, raw in entries:
                self._cancel_cursor = as_str(entry_id)
                fields = entry_fields(raw)
                reason, detail = Reason.MALFORMED, ""
                try:
                    if self.signer is not None and not self.signer.verify(stream, fields):
                        reason, detail = Reason.BAD_SIGNATURE, "missing or wrong HMAC"
                    else:
                        out.append(cancel_from_fields(fields))
                        continue
                except WireError as e:
                    detail = str(e)
                # No consumer group on this stream: phase and digest mean nothing for this dead letter.
                d = Delivery(stream=stream, entry_id=self._cancel_cursor, fields=fields, digest="", phase="decode")
                dead.append(DeadLetter(d, reason, f"cancellation: {detail}"))
        return out, dead


def _by_count(counts: Mapping[str, int]) -> dict[int, dict[str, str]]:
    """The streams grouped by their count, each read from '>': one XREADGROUP per count."""
    by_count: dict[int, dict[str, str]] = {}
    for s, n in counts.items():
        by_count.setdefault(n, {})[s] = ">"
    return by_count
