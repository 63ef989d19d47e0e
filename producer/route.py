"""Routes of several hops, Tracker side: the sans-I/O decisions that drive one session through hops 0..n-1.

A route is hop 0 (tokens in, activations out), then hops that take the previous hop's activations, the
last one sampling the token. The Tracker RELAYS (docs/routes.md): every hop answers into its own hash tag
(its result stream; a prefill chunk's rows in a blob `act:out:<job>` of its tag), and this module turns
hop k's answer into hop k+1's job, whose rows travel inline (a decode step) or in a blob the Tracker writes
into hop k+1's tag (`act:in:<job>`) in the same pipeline as the job. Workers never write another worker's
tag (Redis Cluster safe, per-worker ACLs), only the Tracker signs jobs, and cancellation, replay and
accounting stay in one place.

Nothing here does I/O. A driver (producer/route_drivers.py) loops:
  1. read every live session's result streams (one XREAD per worker), `apply_entries`;
  2. GET the blobs `fetches()` names (one pipeline), `relay()` them;
  3. `advance()` every session (the next decode step at hop 0, a replay, a release), send the Batch.

Per (session, hop, phase, position, attempt) there is exactly one job id (producer.core.job_id); a job is
kept (with its rows) until its hop answers it, so a re-push after an outage is the same job, and a worker
answers a job id once. A state_lost (or unknown_session) at ANY hop replays the whole route: attempt + 1,
prompt + generated re-run through every hop from position 0, each hop re-opening the session; answers of
the old attempt are ignored (their job ids are not the current ones).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas import Reason, SessionSpec, Status, StepJob, StepResult, WorkerKeys, job_to_fields
from schemas.activations import Activations
from schemas.compat import Phase
from schemas.limits import ACTIVATION_TTL_S

from .core import Batch, ProducerCore, SessionFailed, SessionHandle, job_id, read_on

__all__ = ["HopLeg", "Relay", "RouteCore", "RouteHandle", "Sent"]


@dataclass
class Sent:
    """A job pushed to a hop and not answered yet, with the raw rows of its blob (None: inline or tokens),
    so that a re-push after an outage writes the same blob and the same entry again."""

    job: StepJob
    raw: bytes | None = None


@dataclass
class Relay:
    """Hop `hop`'s answer to `job`, whose output rows are in the blob `blob` of `worker_id`'s tag: the driver
    GETs it, then `RouteCore.relay` pushes the next hop's job with those rows."""

    hop: int
    worker_id: str
    job: StepJob
    acts: Activations

    @property
    def blob(self) -> str | None:
        return self.acts.blob


@dataclass
class HopLeg:
    """One hop of one session's route as the Tracker sees it."""

    hop: int
    worker_id: str
    sent: dict[str, Sent] = field(default_factory=dict)  # unanswered jobs of the current attempt, by job id
    closed: bool = False  # this hop answered finished / cancelled, or was released
    engine_seconds: float = 0.0  # charged by this hop's worker for this session (answers of every attempt)
    rows: int = 0  # tokens this hop computed for the session (every attempt)
    bytes_in: int = 0  # activation bytes the Tracker relayed into this hop (inline and blobs)
    blobs_in: int = 0  # of its jobs, how many took their rows from a blob


@dataclass
class RouteHandle(SessionHandle):
    """A session on a route of one or more hops. `generated`, `status`, `finished`, `attempt`, `reason` and
    `detail` mean what they mean on a SessionHandle; `worker_id` is hop 0's. `legs[k]` is hop k;
    `cursors` the last result id read per worker (two hops on one worker share a result stream)."""

    legs: list[HopLeg] = field(default_factory=list)
    cursors: dict[str, str] = field(default_factory=dict)
    relays: list[Relay] = field(default_factory=list)  # blobs to fetch before the next hop can run
    released: bool = False  # the other hops were released (after finish / failure)
    prompt_tokens: int = 0  # billable, as the last hop charged them (the current attempt's opening)
    billed_generated: int = 0  # billable generated tokens, as the last hop charged them
    feed: bool = False  # the last hop sampled a token that hop 0 has not been given yet

    @property
    def last_hop(self) -> int:
        return len(self.legs) - 1

    def stream_keys(self) -> dict[str, str]:
        """Result stream key -> worker id, one per worker on the route."""
        return {WorkerKeys(w).results(self.session_id): w for w in self.cursors}

    @property
    def awaiting(self) -> int:
        """Jobs pushed and not answered, plus relays not yet pushed."""
        return sum(len(leg.sent) for leg in self.legs) + len(self.relays)


class RouteCore:
    """Every decision of driving sessions over routes. Settings (chunk size, attempts, signing, TTLs) are the
    ProducerCore's, so a Producer drives one-hop and many-hop sessions with one configuration."""

    def __init__(self, core: ProducerCore, *, blob_ttl_s: int = ACTIVATION_TTL_S) -> None:
        self.core = core
        self.blob_ttl_s = blob_ttl_s

    # ---------------------------------------------------------------- opening

    def validate(self, spec: SessionSpec, prompt: Sequence[int]) -> tuple[int, ...]:
        """The prompt as ints; with verify_route every hop's worker must have been discovered and advertise
        its hop's keys (`route_workers_to_discover`). Hop 0 takes tokens, every later hop activations."""
        toks = self.core.check_shape(spec, prompt, 0)
        for k, rh in enumerate(spec.route):
            b = rh.key.boundary
            if k > 0 and b.consumes != "hidden":
                raise ValueError(f"hop {k} of the route must consume hidden activations, not {b.consumes}")
            last = k == len(spec.route) - 1
            if (b.produces == "logits") != last:
                raise ValueError(f"hop {k} produces {b.produces}: only the last hop may produce logits")
            if k > 0:
                prev = spec.route[k - 1].key.boundary
                if prev.last_layer != b.first_layer or prev.hidden_size != b.hidden_size or prev.dtype != b.dtype:
                    raise ValueError(f"hop {k - 1} and hop {k} do not join (blocks, hidden size or dtype differ)")
            if self.core.verify_route:
                self.core.validate(spec, toks, k) if k == 0 else self._advertised(spec, k)
        return toks

    def _advertised(self, spec: SessionSpec, hop: int) -> None:
        rh = spec.route[hop]
        info = self.core.discovered[rh.worker_id][1]
        for phase in ("prefill", "decode"):
            d = rh.key.for_phase(phase).digest
            if d not in info.digests:
                raise ValueError(f"worker {rh.worker_id!r} does not advertise hop {hop}'s {phase} key {d}")

    def route_workers_to_discover(self, spec: SessionSpec) -> list[str]:
        out: list[str] = []
        for k in range(len(spec.route)):
            w = self.core.route_worker_to_discover(spec, k)
            if w is not None and w not in out:
                out.append(w)
        return out

    def new_handle(self, spec: SessionSpec, prompt: Sequence[int]) -> RouteHandle:
        toks = self.validate(spec, prompt)
        legs = [HopLeg(hop=k, worker_id=rh.worker_id) for k, rh in enumerate(spec.route)]
        return RouteHandle(spec=spec, prompt=toks, worker_id=spec.route[0].worker_id, hop=0, opened_at=time.time(),
                           legs=legs, cursors={leg.worker_id: "0-0" for leg in legs})

    # ---------------------------------------------------------------- jobs

    def _job(self, h: RouteHandle, hop: int, phase: Phase, start: int, tokens: tuple[int, ...], sample: bool,
             session: SessionSpec | None, hidden: Activations | None, created_at: float) -> StepJob:
        key = h.spec.route[hop].key.for_phase(phase)
        return StepJob(job_id=job_id(h.session_id, hop, phase, start, h.attempt), session_id=h.session_id, hop=hop,
                       phase=phase, compat=key.digest, start_position=start, tokens=tokens, sample=sample,
                       attempt=h.attempt, created_at=created_at, session=session, hidden=hidden)

    def _push(self, batch: Batch, h: RouteHandle, hop: int, sent: Sent) -> None:
        """XADD the job to its hop's input stream (and SET its blob first: same worker tag, one pipeline)."""
        keys = WorkerKeys(h.legs[hop].worker_id)
        job = sent.job
        if sent.raw is not None:
            assert job.hidden is not None and job.hidden.blob is not None
            batch.set(job.hidden.blob, sent.raw, ex=self.blob_ttl_s)
        stream = keys.input_stream(job.compat, job.phase)
        batch.xadd(stream, self.core.entry(stream, job_to_fields(job)))
        h.legs[hop].sent[job.job_id] = sent

    def queue_open(self, batch: Batch, h: RouteHandle) -> None:
        """Push prompt + the generated tokens of earlier attempts to hop 0 as prefill chunks of the handle's
        attempt (what a one-hop route does: ProducerCore.prefill_jobs, hop 0)."""
        h.replayed_generated = len(h.generated)
        for leg in h.legs:
            leg.sent.clear()
            leg.closed = False
        h.relays.clear()
        h.released = False
        h.status, h.reason, h.detail = "open", None, ""
        h.feed = False
        for job in self.core.prefill_jobs(h):  # h.hop is 0: hop 0's jobs, the spec on the opening chunk
            self._push(batch, h, 0, Sent(job))
        h.position = len(h.prompt) + h.replayed_generated
        h.jobs = {jid for leg in h.legs for jid in leg.sent}

    def queue_decode(self, batch: Batch, h: RouteHandle, token: int) -> None:
        """The next decode step at hop 0: the token the last hop sampled, at the session's next position."""
        job = self._job(h, 0, "decode", h.position, (token,), True, None, None, time.time())
        self._push(batch, h, 0, Sent(job))
        h.position += 1

    def _next_job(self, h: RouteHandle, hop: int, prev: StepJob, acts: Activations, raw: bytes | None) -> Sent:
        """Hop `hop`'s copy of hop hop-1's job `prev`, carrying its output rows: inline as they came, or in a
        blob of hop `hop`'s tag named by the new job's id."""
        nxt = self._job(h, hop, prev.phase, prev.start_position, prev.tokens, prev.sample, prev.session, None,
                        prev.created_at)
        if acts.inline:
            return Sent(nxt.replace(hidden=acts))
        assert raw is not None
        moved = acts.moved(WorkerKeys(h.legs[hop].worker_id).activations_in(nxt.job_id))
        return Sent(nxt.replace(hidden=moved), raw)

    # ---------------------------------------------------------------- results

    def apply_entries(self, h: RouteHandle, worker_id: str, entries: Iterable[tuple[Any, Any]],
                      batch: Batch) -> list[StepResult]:
        """Apply one worker's result-stream entries to the session (read on from its cursor); inline relays
        are queued on `batch` at once, blob relays wait in h.relays. Returns the results applied."""
        applied: list[StepResult] = []
        for r in _read_on(h, worker_id, entries):
            if self.apply(h, r, batch):
                applied.append(r)
        return applied

    def apply(self, h: RouteHandle, r: StepResult, batch: Batch) -> bool:
        """One result of any hop. False (ignored) when it answers no current job of the session."""
        if r.session_id != h.session_id:
            return False
        hop = next((leg.hop for leg in h.legs if r.job_id in leg.sent), None)
        if hop is None:
            return False
        leg = h.legs[hop]
        sent = leg.sent.pop(r.job_id)
        h.jobs.discard(r.job_id)
        h.last_result = r
        leg.engine_seconds += r.accounting.engine_seconds
        if r.status != Status.OK:
            h.reason, h.detail = (r.reason.value if r.reason else None), f"hop {hop}: {r.detail}"
            if r.status == Status.STATE_LOST or (r.status == Status.REJECTED and r.reason == Reason.UNKNOWN_SESSION):
                self._lose(h)
            else:
                if r.status == Status.CANCELLED:
                    leg.closed = True
                self._end(h, r.status.value)
            return True
        leg.rows += len(sent.job.tokens)
        if hop == h.last_hop:
            h.prompt_tokens += r.accounting.prompt_tokens
            h.billed_generated += r.accounting.generated_tokens
            if r.token is not None:
                h.generated.append(r.token)
            if r.finished:
                leg.closed = True
                self._end(h, "finished")
            elif sent.job.sample and r.token is None:
                self._end(h, "failed", "the last hop's sampling answer carried no token")
            elif r.token is not None:
                h.feed = True  # advance() pushes the token to hop 0
            return True
        if r.finished:
            leg.closed = True  # this hop is done with the session (it counts max_tokens itself)
        if r.hidden is None:
            self._end(h, "failed", f"hop {hop} answered without activations")
            return True
        if r.hidden.rows != len(sent.job.tokens):
            self._end(h, "failed", f"hop {hop} answered {r.hidden.rows} rows for {len(sent.job.tokens)} tokens")
            return True
        # Queued, inline rows too: a hop's jobs must reach the next hop in position order, and an earlier
        # chunk may still wait for its blob (relay() pushes them in order).
        h.relays.append(Relay(hop=hop, worker_id=leg.worker_id, job=sent.job, acts=r.hidden))
        h.jobs = {jid for lg in h.legs for jid in lg.sent}
        return True

    def _lose(self, h: RouteHandle) -> None:
        h.status = "state_lost"
        h.feed = False
        h.relays.clear()
        for leg in h.legs:
            leg.sent.clear()
        h.jobs = set()

    def _end(self, h: RouteHandle, status: str, detail: str | None = None) -> None:
        h.finished, h.status = True, status
        if detail is not None:
            h.detail = detail
        h.feed = False
        h.relays.clear()
        for leg in h.legs:
            leg.sent.clear()
        h.jobs = set()

    # ---------------------------------------------------------------- relaying blobs

    @staticmethod
    def fetches(handles: Iterable[RouteHandle]) -> dict[str, list[str]]:
        """The output blobs to GET, by worker (one pipeline; the keys of one worker share its tag)."""
        out: dict[str, list[str]] = {}
        for h in handles:
            for rl in h.relays:
                if rl.blob is not None:
                    out.setdefault(rl.worker_id, []).append(rl.blob)
        return out

    def relay(self, batch: Batch, h: RouteHandle, blobs: dict[str, bytes | None]) -> None:
        """Push the next hop's job for every relay whose blob was fetched (`blobs`: key -> bytes, None when
        missing), and DEL the output blob (the Tracker keeps the bytes until the next hop answers). A blob
        that is gone (expired, or its worker lost it) is a lost state: the route is replayed."""
        relays, h.relays = h.relays, []
        blocked: set[int] = set()  # hops with an earlier relay still waiting: later ones wait behind it
        for rl in relays:
            if rl.hop in blocked or (rl.blob is not None and rl.blob not in blobs):
                blocked.add(rl.hop)
                h.relays.append(rl)  # its blob was not fetched this round
                continue
            raw = blobs[rl.blob] if rl.blob is not None else None
            if rl.blob is not None and raw is None:
                h.reason, h.detail = Reason.BAD_ACTIVATIONS.value, f"hop {rl.hop}: output blob {rl.blob} is gone"
                self._lose(h)
                return
            self._push(batch, h, rl.hop + 1, self._next_job(h, rl.hop + 1, rl.job, rl.acts, raw))
            h.legs[rl.hop + 1].bytes_in += rl.acts.nbytes
            h.legs[rl.hop + 1].blobs_in += rl.blob is not None
            if rl.blob is not None:
                batch.ops.append(("delete", (rl.blob,), {}))
        h.jobs = {jid for leg in h.legs for jid in leg.sent}

    # ---------------------------------------------------------------- advancing

    def advance(self, batch: Batch, h: RouteHandle, replay_state_lost: bool, *, cancel_marked: bool = False) -> bool:
        """Queue what the session needs next: the sampled token to hop 0, a replay after a lost state, or
        the release of the other hops once it ended. True when something was queued."""
        if h.finished:
            return self.queue_release(batch, h)
        if h.status == "state_lost":
            if not replay_state_lost:
                h.finished = True
                return self.queue_release(batch, h)
            try:
                self.queue_replay(batch, h, cancel_marked=cancel_marked)
            except SessionFailed:
                return self.queue_release(batch, h)
            return True
        if h.feed:
            h.feed = False
            self.queue_decode(batch, h, h.generated[-1])
            h.jobs = {jid for leg in h.legs for jid in leg.sent}
            return True
        return False

    def queue_replay(self, batch: Batch, h: RouteHandle, *, cancel_marked: bool) -> None:
        """After a lost state at any hop: attempt + 1, prompt + generated through every hop again.
        `cancel_marked`: hop 0's cancel marker is set: nothing is pushed, the session ends cancelled."""
        if cancel_marked:
            self._end(h, "cancelled", "cancelled before the replay")
            h.reason = Reason.CANCELLED.value
            return
        if h.attempt + 1 > self.core.max_attempts:
            self._end(h, "state_lost")
            raise SessionFailed(h)
        if len(h.generated) >= h.spec.max_tokens:
            self._end(h, "finished")
            return
        h.attempt += 1
        h.finished = False
        self.queue_open(batch, h)

    def queue_release(self, batch: Batch, h: RouteHandle) -> bool:
        """Once an ended session: cancel it on every hop that did not close it (a non-last hop never sees a
        stop token; a failed hop leaves the others holding slots). One cancel per worker."""
        if h.released or len(h.legs) == 1:
            return False
        h.released = True
        workers = {leg.worker_id for leg in h.legs if not leg.closed}
        for w in sorted(workers):
            self.core.cancel_ops(batch, w, h.session_id)
        for leg in h.legs:
            leg.closed = True
        return bool(workers)

    def cancel_ops(self, h: RouteHandle) -> dict[str, Batch]:
        """The cancel of a session on every hop of its route: one Batch (marker + event) per worker, each to
        send as its own transaction (one hash tag each)."""
        out: dict[str, Batch] = {}
        for leg in h.legs:
            if leg.worker_id not in out:
                out[leg.worker_id] = Batch()
                self.core.cancel_ops(out[leg.worker_id], leg.worker_id, h.session_id)
        return out

    def queue_unanswered(self, batch: Batch, h: RouteHandle) -> int:
        """Re-push every job the session has unanswered at any hop, blobs included (idempotent: same job ids,
        same bytes). The relays not yet pushed are fetched again by the driver."""
        if h.finished or h.status == "state_lost":
            return 0
        n = 0
        for leg in h.legs:
            for sent in list(leg.sent.values()):
                self._push(batch, h, leg.hop, sent)
                n += 1
        return n

    @staticmethod
    def by_worker(handles: Iterable[RouteHandle]) -> dict[str, dict[str, tuple[RouteHandle, str]]]:
        """Per worker: result stream key -> (handle, its cursor on that worker): one XREAD per worker, over
        the streams where an answer is awaited (a session with none awaited anywhere: all of its streams).
        Workers are ordered by how many answers they owe, most last (the driver blocks on that one)."""
        out: dict[str, dict[str, tuple[RouteHandle, str]]] = {}
        owed: dict[str, int] = {}
        for h in handles:
            waiting = {leg.worker_id for leg in h.legs if leg.sent} or set(h.cursors)
            for w in waiting:
                out.setdefault(w, {})[WorkerKeys(w).results(h.session_id)] = (h, h.cursors[w])
                owed[w] = owed.get(w, 0) + sum(len(leg.sent) for leg in h.legs if leg.worker_id == w)
        return {w: out[w] for w in sorted(out, key=lambda w: (owed[w], w))}


def _read_on(h: RouteHandle, worker_id: str, entries: Iterable[tuple[Any, Any]]) -> Iterator[StepResult]:
    """read_on (producer.core) over one of the session's result streams, moving that worker's cursor."""
    shadow = SessionHandle(spec=h.spec, prompt=h.prompt, worker_id=worker_id, last_result_id=h.cursors[worker_id])
    for r in read_on(shadow, entries):
        h.cursors[worker_id] = shadow.last_result_id
        yield r
    h.cursors[worker_id] = shadow.last_result_id
