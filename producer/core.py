"""The Tracker's sans-I/O core: every decision of the Tracker side, as plans, no Redis call and no sleep.

A plan is a generator that yields the requests it needs (producer/commands.py: typed commands, no client) and
receives their replies, parsed; both drivers (`Producer`, `AsyncProducer`) only run plans, each on its own event
loop. The state a plan moves: sessions (producer/session.py, one state machine for every route length), what
they need next (producer/steps.py), and where reading each result stream stands.

One result stream per Tracker and worker: every job names `reply_to` = the Tracker id, so a worker files ONE
entry per completion call for all of this Tracker's sessions (`dgr:{W}:out:<tracker>`, docs/wire-format.md). A
read is one XREAD per worker (one hash tag: Redis Cluster safe) from the stream's cursor; each record is decoded
once and its rows applied to their sessions by id (rows the worker did not publish, `c.d`, skipped). So the
Tracker's Redis work is O(completion calls), and its Python per row a lookup and one call. After a Redis outage
the cursors go back `rewind_ms` (a new master may write ids below them after a failover): answers re-read are
ignored (their jobs were answered), so nothing is skipped nor applied twice.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from schemas import SessionSpec, StepResult, WireError, WorkerKeys
from schemas.keys import PREFIX
from schemas.replies import id_tuple
from schemas.wire import decode_record, row_to_result

from .commands import Batch, Exists, Get, Plan, Read, XAdd, XRead
from .errors import ResultTimeout
from .moves import Mover
from .placement import FleetView, Placer, SessionTemplate
from .route import relay
from .session import Run, SessionHandle, Sessions, apply, apply_result, restore
from .settings import DECODE_N, READ_COUNT, ProducerSettings
from .steps import Steps, job_id, one_hop
from .validate import Advertisements, TrackerAdmission, WorkerInfo, check_id, check_token, check_tokens

__all__ = ["DECODE_N", "READ_COUNT", "ProducerCore", "Run", "job_id"]

log = logging.getLogger("dgr.producer")


class ProducerCore(Steps, TrackerAdmission, Placer, Mover):
    """Settings, caches and every plan of the Tracker side (see the module docstring)."""

    apply = staticmethod(apply_result)

    def __init__(self, settings: ProducerSettings | None = None, **options: Any) -> None:
        self.settings = ProducerSettings.of(settings, options)
        self.lag: dict[str, tuple[float, int]] = {}  # stream -> (monotonic time asked, lag)
        self.discovered: dict[str, tuple[float, WorkerInfo]] = {}
        self.advertised = Advertisements()  # each worker's spec as last read (the fleet's reads)
        self.prefix_summaries: dict[str, tuple[str, dict[str, Any]]] = {}
        self.driven: dict[str, SessionHandle] = {}  # by session id: sessions a Run drives
        self.by_hand: weakref.WeakValueDictionary[str, SessionHandle] = weakref.WeakValueDictionary()
        self.reads: dict[str, dict[str, int]] = {}  # worker -> {result stream: driven sessions reading it}
        self.cursors: dict[str, str] = {}  # result stream -> the last entry id read
        self.answered: dict[str, float] = {}  # worker -> monotonic time of its last record read (timeouts)
        self.touched: dict[str, SessionHandle] = {}  # driven sessions moved since their last advance
        self.outage = False  # a driver sets it when Redis answers again after an outage
        self.refused = 0  # result entries that could not be decoded (another wire version: logged)
        self.expect: str | None = None  # the worker the last pushes went to (producer reads block on it)
        self.cancels: deque[tuple[float, str, str]] = deque()  # (monotonic time, worker, session): sent again
        self.abandoned: deque[tuple[str, str]] = deque()  # (worker, session): to cancel, the driver stopped early
        self.fleet = FleetView()  # placement's view of the workers (producer/placement.py)
        self.policy = self.settings.placement
        self.checked_at = time.monotonic()  # the last look for lost workers (producer/moves.py)
        self.waiting: dict[str, float] = {}  # placed sessions refused for a slot, since when (producer/moves.py)
        self.waited_at = float("-inf")  # the last look for room for them

    def opening(self, spec: SessionSpec | SessionTemplate, prompt: Sequence[int],
                hop: int = 0) -> Plan[SessionHandle]:
        """TrackerAdmission.opening, a template placed first (its workers then count as discovered: placement read
        their advertisements within discover_cache_s)."""
        template = spec if isinstance(spec, SessionTemplate) else None
        if isinstance(spec, SessionTemplate):
            prompt = check_tokens(prompt, None)  # the tuple checked, passed on (checked again, not passed over)
            spec = yield from self.place(spec, prompt)
            # as fresh as the fleet placement read, or as the read in flight that the placement did not wait for
            # (FleetView.reading): never older, so `to_discover` asks no worker's advertisement again per opening
            at = self.fleet.read_at if self.fleet.reading is None else time.monotonic()
            for rh in spec.route:  # by id: a pass over the fleet was 41 us a session at 100 workers (timeit)
                w = self.fleet.by_id.get(rh.worker_id)
                if w is not None:
                    self.discovered[w.worker_id] = (at, w)
        h = yield from TrackerAdmission.opening(self, spec, prompt, hop)
        h.template = template
        return h

    # ---------------------------------------------------------------- sessions driven by hand

    def open(self, spec: SessionSpec | SessionTemplate, prompt: Sequence[int], hop: int = 0) -> Plan[SessionHandle]:
        h = yield from self.opening(spec, prompt, hop)
        one_hop(h)
        yield from self.admit(h.input_stream("prefill"), wait=True)
        batch = Batch(transaction=True, tag=h.worker_id)
        self.queue_prefill(batch, h)
        yield self.pushed(batch)
        self.by_hand[h.session_id] = h
        return h

    def push_decode(self, h: SessionHandle, token: int) -> Plan[str]:
        self.check_handles([h])
        batch = Batch()
        vocab = self.vocab(h.worker_id, h.spec.route[h.hop].key.for_phase("decode").digest)
        jid = self.queue_decode(batch, h, check_token(token, vocab))
        yield batch
        return jid

    def replay(self, h: SessionHandle) -> Plan[None]:
        self.check_handles([h])
        marked = yield from self.cancelled(h.worker_id, h.session_id)
        batch = Batch(transaction=True, tag=h.worker_id)
        # by hand: the caller feeds the decode steps, so the tokens go again as prompt (none to sample again)
        self.queue_replay(batch, h, cancel_marked=marked, regenerate=False)
        if batch:
            yield batch

    def cancel(self, worker_id: str, session_id: str) -> Plan[None]:
        yield from self._cancel([worker_id], session_id)

    def cancel_route(self, h: SessionHandle) -> Plan[None]:
        self.check_handles([h])
        yield from self._cancel([leg.worker_id for leg in h.legs], h.session_id)

    def _cancel(self, workers: list[str], session_id: str) -> Plan[None]:
        """One transaction per worker; kept for rewind_ms, to send again after an outage (a failover loses the
        writes of its last moments)."""
        for b in self.cancel_batches(workers, session_id):
            yield b
            self.cancels.append((time.monotonic(), b.tag or "", session_id))
        self._recent_cancels()

    def _recent_cancels(self) -> None:
        while self.cancels and time.monotonic() - self.cancels[0][0] > self.settings.rewind_ms / 1000:
            self.cancels.popleft()

    def cancelled(self, worker_id: str, session_id: str) -> Plan[bool]:
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        (marked,) = yield Read((Exists(keys.cancel_marker(check_id(session_id, "session_id"))),))
        return bool(marked)

    def read_results(self, handles: Sequence[SessionHandle], block_ms: int) -> Plan[dict[str, list[StepResult]]]:
        """Read the handles' result streams (one XREAD per worker, the busiest blocking up to block_ms) until one
        of them got answers; apply them and return the handles' answers of their current attempts, by session."""
        if isinstance(block_ms, bool) or not isinstance(block_ms, int):
            raise TypeError(f"block_ms must be an int, not {type(block_ms).__name__}")
        self.check_handles(handles)
        for h in handles:
            if h.run is None:
                self.by_hand[h.session_id] = h
        deadline = time.monotonic() + max(0, block_ms) / 1000
        while True:
            yield from self.read(handles, int((deadline - time.monotonic()) * 1000))
            if any(h.inbox for h in handles) or time.monotonic() >= deadline:
                break
        out = {h.session_id: h.inbox for h in handles if h.inbox}
        for h in handles:
            h.inbox = []
        return out

    # ---------------------------------------------------------------- sessions a Run drives

    def start(self, sessions: Sessions, start_times: Sequence[float] | None = None,
              resume: Sequence[SessionHandle] = (), replay: bool = True, collect: bool = False) -> Run:
        if start_times is not None and len(start_times) != len(sessions):
            raise ValueError("start_times must give one time per session")
        self.check_handles(resume)
        ids = [spec.session_id for spec, _ in sessions] + [h.session_id for h in resume]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate session ids")
        times = list(start_times) if start_times is not None else [0.0] * len(sessions)
        run = Run(sessions, times, replay, collect, pending=deque(sorted(range(len(sessions)), key=times.__getitem__)))
        for h in resume:
            self.drive(h, run)
            self.touched[h.session_id] = h  # its next step may be due (a handle rebuilt by resume())
        return run

    def open_many(self, run: Run, due: list[int], *, wait: bool) -> Plan[None]:
        """Open the run's sessions `due` (indexes): one MULTI/EXEC per hop-0 worker, so a worker reads them all at
        once (a worker that read the first few would size its prefill calls by the decode calls it then runs).
        Backpressure: wait=True applies the policy (raise, or wait); wait=False defers those the worker cannot
        take now to a later call."""
        batches: dict[str, Batch] = {}
        left = deque(due)
        while left:
            h = yield from self.opening(*run.sessions[left[0]])
            if not (yield from self.admit(h.input_stream("prefill"), wait=wait)):
                break
            self.queue_prefill(batches.setdefault(h.worker_id, Batch(transaction=True, tag=h.worker_id)), h, ramp=True)
            self.drive(h, run)
            left.popleft()
        run.pending.extendleft(reversed(left))
        for batch in batches.values():
            yield self.pushed(batch)

    def drive(self, h: SessionHandle, run: Run) -> None:
        h.run = run
        run.handles[h.session_id] = h
        if h.finished:
            return
        self.driven[h.session_id] = h
        run.live += 1
        now = time.monotonic()
        for w, stream in self.streams_of(h):
            reading = self.reads.setdefault(w, {})
            if not reading:
                self.answered[w] = now  # the timeout's clock starts with the worker's first session
            reading[stream] = reading.get(stream, 0) + 1

    def retire(self, h: SessionHandle, abandon: bool = False) -> None:
        """Stop driving a session (it ended, timed out, or its driver went away). `abandon`: one that has not ended
        (a timeout, its caller's cancellation, a callback's exception) is cancelled on every worker of its route
        (`release_abandoned`), so no worker holds its slot until the reaper."""
        if self.driven.get(h.session_id) is not h:
            return
        if abandon and not h.finished:
            self.abandoned.extend((w, h.session_id) for w in self.release_workers(h))
            restore(h)  # amid a replay's tokens sampled again: its caller's view is every token it had
        del self.driven[h.session_id]
        self.touched.pop(h.session_id, None)
        self.fleet.started(h.session_id)
        h.run.live -= 1
        for w, stream in self.streams_of(h):
            reading = self.reads[w]
            reading[stream] -= 1
            if not reading[stream]:
                del reading[stream]
                if not reading:
                    del self.reads[w]

    def stop(self, run: Run, abandon: bool = True) -> None:
        """Stop driving a run's sessions; those that have not ended are abandoned (`retire`), unless the caller
        drives them on by hand (`abandon` False: a `poll`)."""
        for h in list(run.handles.values()):
            self.retire(h, abandon)
        for h in run.handles.values():  # a run and its handles held each other: garbage only the collector took
            if h.run is run:
                h.run = None

    def release_abandoned(self) -> Plan[None]:
        """Send the cancels of the sessions abandoned (`retire`): the durable cancel path (`_cancel`: one transaction
        per worker, sent again after an outage). One left unsent (Redis away) goes with the next turn. Taken off the
        queue before it is sent: AsyncProducer runs this plan in the pump and in a task leaving a run at once, and
        both taking the first entry sent it twice and popped one never sent (or an empty queue)."""
        while self.abandoned:
            entry = self.abandoned.popleft()
            try:
                yield from self._cancel([entry[0]], entry[1])
            except BaseException:  # not sent (the I/O failed, or the plan was dropped): first in the next turn
                self.abandoned.appendleft(entry)
                raise

    # ---------------------------------------------------------------- reading, applying, advancing

    def read(self, handles: Sequence[SessionHandle] = (), block_ms: int = 0) -> Plan[bool]:
        """One read of every result stream driven sessions and `handles` wait on, applied: one XREAD per worker
        (one hash tag each: a blocking read cannot wait on two in a Cluster), in one pipeline whose last read
        blocks, on the worker the last pushes went to (its answer wakes it; Redis times a blocked read out only
        every 100 ms or so when nothing else happens). A read that rode through an outage is made again, once the
        Tracker recovered (`recover`). True when something was applied."""
        streams = {w: dict(s) for w, s in self.reads.items()}
        for h in handles:
            for w, stream in self.streams_of(h):
                streams.setdefault(w, {})[stream] = 1
        replies: Any = None
        while replies is None or self.outage:
            yield from self.recover()
            if not streams:
                return False
            order = sorted(streams, key=lambda w: (w == self.expect, w))
            replies = yield Read(tuple(XRead(tuple((s, self.cursor(s)) for s in sorted(streams[w])), READ_COUNT,
                                             block_ms if w == order[-1] and block_ms > 0 else None) for w in order))
        got = False
        for reply in replies:
            for stream, entries in reply:
                got = self.ingest(stream, entries) or got
        return got

    def pushed(self, batch: Batch) -> Batch:
        """Note the worker most of a batch's jobs went to: the next read blocks on it."""
        jobs = Counter(op.stream.split("}", 1)[0] for op in batch.ops if isinstance(op, XAdd) and ":in:" in op.stream)
        if jobs:
            self.expect = jobs.most_common(1)[0][0][len(PREFIX) + 2:]
        return batch

    def ingest(self, stream: str, entries: Sequence[tuple[str, Any]]) -> bool:
        """Apply a result stream's records (the hot path: one decode per record, a lookup per row); answers of
        sessions driven by hand go to their `inbox`, of driven ones to their Run's callbacks (when it has any)."""
        if not entries:
            return False
        driven, by_hand, touched, prefilling = self.driven, self.by_hand, self.touched, self.fleet.prefilling
        for eid, fields in entries:
            try:
                rec, chg = decode_record(fields)
            except WireError as e:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.error("result entry refused", extra={"stream": stream, "entry": eid, "reason": e.reason.value,
                                                             "detail": str(e)[:200], "refused": self.refused})
                continue
            skip = frozenset(chg.d) if chg.d else ()
            jobs, offs, sts, poss, toks, fins, ess, ps, gs, x = (
                rec.job, rec.offset, rec.status, rec.position, rec.token, rec.finished, rec.engine_seconds, chg.p,
                chg.g, rec.extra)
            for i, sid in enumerate(rec.session_id):
                h = driven.get(sid) or by_hand.get(sid)
                if h is None:
                    continue
                s = h.sent.get(jobs[i])
                if s is None or i in skip or not apply(h, s, offs[i], sts[i], poss[i], toks[i], fins[i],
                                                       x.get(str(i)) if x else None, ess[i], ps[i], gs[i],
                                                       chg.k[i] if chg.k else 0):
                    continue
                h.last_result_id, h.last_row = eid, (rec, chg, i)
                if prefilling and sid in prefilling and (h.generated or h.finished):
                    self.fleet.started(sid)  # its prompt is computed: no longer a wait for the next (placement)
                run = h.run
                if run is None:
                    h.inbox.append(row_to_result(rec, chg, i))
                else:
                    touched[sid] = h
                    if run.collect and not h.echo:  # a token decoded again by a replay: its caller had it
                        run.results.append((h, row_to_result(rec, chg, i)))
        last = entries[-1][0]
        if id_tuple(last) > id_tuple(self.cursor(stream)):
            self.cursors[stream] = last
        self.answered[stream.split("{", 1)[1].split("}", 1)[0]] = time.monotonic()
        return True

    def advance_touched(self) -> Plan[list[SessionHandle]]:
        """Every driven session moved since its last advance: relay its rows (the blobs fetched in one
        pipeline), ask whether a session about to be replayed was cancelled, and push every next job in ONE
        pipeline, before any callback runs. The sessions, for the driver to call back and wake."""
        yield from self.release_abandoned()
        yield from self.move_lost()  # sessions of a lost worker: placed again, replayed below
        yield from self.place_waiting()  # sessions refused for a slot: placed again where there is room
        hs = list(self.touched.values())
        self.touched = {}
        if not hs:
            return hs
        wanted = [rl.blob for h in hs for rl in h.relays if rl.blob is not None]
        blobs: dict[str, bytes | None] = {}
        if wanted:
            blobs = dict(zip(wanted, (yield Read(tuple(Get(k) for k in wanted))), strict=True))
        lost = [h for h in hs if h.awaits_replay and h.run is not None and h.run.replay]
        marked: set[str] = set()
        if lost:
            replies = yield Read(tuple(Exists(WorkerKeys(h.worker_id).cancel_marker(h.session_id)) for h in lost))
            marked = {h.session_id for h, m in zip(lost, replies, strict=True) if m}
        batch = Batch()
        for h in hs:
            if h.relays:
                relay(self, batch, h, blobs)
            self.advance(batch, h, h.run is None or h.run.replay, cancel_marked=h.session_id in marked)
            if h.finished:
                self.retire(h)
        if batch:
            yield self.pushed(batch)
        return hs

    def recover(self) -> Plan[None]:
        """Redis answered again after an outage: read the result streams again from `rewind_ms` before their
        cursors; send again the cancels of the last `rewind_ms` (a failover may have lost them) and every driven
        session's unanswered jobs (idempotent); advance them all (the next step of a session whose answer was read
        just before the outage). Time in the outage is no timeout."""
        if not self.outage:
            return
        self.outage = False
        now, rewind = time.monotonic(), self.settings.rewind_ms
        for stream, c in self.cursors.items():
            ms = id_tuple(c)[0]
            if ms:
                self.cursors[stream] = f"{max(0, ms - rewind)}-0"
        self.answered = dict.fromkeys(self.answered, now)
        batch = Batch()
        self._recent_cancels()
        for _, worker_id, session_id in self.cancels:
            self.cancel_ops(batch, worker_id, session_id)
        n = sum(self.queue_unanswered(batch, h) for h in self.driven.values())
        self.touched.update(self.driven)
        log.warning("re-pushed unanswered jobs after a redis outage", extra={"sessions": len(self.driven), "jobs": n})
        if batch:
            yield batch

    def turn(self, block_ms: int) -> Plan[list[SessionHandle]]:
        """One turn of a driver's loop: read (after an outage: recover first), advance."""
        yield from self.read((), block_ms)
        return (yield from self.advance_touched())

    def expire(self) -> list[Run]:
        """Stop driving the sessions waiting on a worker that answered nothing for timeout_s (a session queued
        behind others is not timed out while its worker answers them); their Runs get a ResultTimeout."""
        now, limit = time.monotonic(), self.settings.timeout_s
        silent = {w for w in self.reads if now - self.answered.get(w, now) > limit}
        if not silent:
            return []
        waiting = [h for h in self.driven.values() if h.status != "awaiting_room"  # no answer due: moves.py's limit
                   and not silent.isdisjoint({h.legs[s.hop].worker_id for s in h.sent.values()} or {h.worker_id})]
        for h in waiting:
            h.run.error = h.run.error or ResultTimeout(f"session {h.session_id}: no answer from worker "
                                                       f"{h.legs[0].worker_id} for {limit} s")
            self.retire(h, abandon=True)
        return list(dict.fromkeys(h.run for h in waiting))

    def block_ms(self, until_s: float | None = None) -> int:
        """How long a read may block: read_block_ms, no longer than the next timeout, the next start, or the next
        look for room while sessions wait for it (producer/moves.py: no result may come to wake the read)."""
        if self.settings.read_block_ms <= 0:
            return 0
        now = time.monotonic()
        oldest = min((self.answered.get(w, now) for w in self.reads), default=now)
        wait = min(self.settings.read_block_ms / 1000, self.settings.timeout_s - (now - oldest))
        if until_s is not None:
            wait = min(wait, until_s)
        if self.waiting:
            wait = min(wait, max(0.0, self.policy.lost_check_s - (now - self.waited_at)))
        return max(1, int(wait * 1000))
