"""What a session needs next, as commands: the opening (prefill chunks and the session's record), the next
decode job, a replay after a lost state, the release of the other hops, a cancel, the re-push of what is
unanswered. The core (producer/core.py) is a `Steps`; nothing here does I/O.

Per (session, hop, phase, position, attempt) there is exactly one job id (`job_id`), and a worker answers a
job id once: pushing a job again (a retry, an `open()` called twice, a re-push after an outage) yields one
answer. To run a step again after an answer, bump the attempt (a replay). A replay re-opens the session on
every hop: prompt + generated as prefill, the SessionSpec's `prompt_len` the prompt's length (the worker then
computes the generated positions one row per call, as when they were decoded: docs/invariance.md).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from schemas import Phase, Reason, SessionSpec, StepJob, WorkerKeys, cancel_to_fields, job_to_fields
from schemas.activations import Activations
from schemas.limits import CANCEL_MAXLEN, MAX_GENERATE, MAX_POSITION

from .commands import Batch, Expire, HSet, Set, XAdd
from .errors import SessionFailed
from .session import Sent, SessionHandle, drop, end, job_n, restore
from .validate import check_id

if TYPE_CHECKING:
    from .placement import FleetView
    from .settings import ProducerSettings
    from .validate import WorkerInfo

__all__ = ["Steps", "job_id", "queue_next", "tokens_per_job"]


def job_id(session_id: str, hop: int, phase: Phase, position: int, attempt: int) -> str:
    """Deterministic job id: 40 hex chars of sha1 over (session, hop, phase, position, attempt)."""
    check_id(session_id, "session_id")
    raw = f"{session_id}\x1f{hop}\x1f{phase}\x1f{position}\x1f{attempt}".encode()
    return hashlib.sha1(raw, usedforsecurity=False).hexdigest()


def one_hop(h: SessionHandle) -> None:
    if len(h.spec.route) > 1:
        raise ValueError("a route of several hops is driven by run_many / generate (docs/routes.md), not step by step")


class Steps:
    """The decisions that become commands. Methods named `queue_*` add to a Batch and move the handle as if it
    were sent (a driver sends the Batch before anything else looks at the handle)."""

    settings: ProducerSettings
    discovered: dict[str, tuple[float, WorkerInfo]]
    cursors: dict[str, str]  # result stream -> the last entry id read
    cancels: deque[tuple[float, str, str]]  # (monotonic time, worker, session): cancels sent, to send again
    waiting: dict[str, float]  # session id -> monotonic time since it awaits room (producer/moves.py)
    fleet: FleetView

    def cursor(self, stream: str) -> str:
        return self.cursors.get(stream, "0-0")

    @staticmethod
    def streams_of(h: SessionHandle) -> set[tuple[str, str]]:
        """(worker, result stream) of every hop of the session."""
        reply = h.reply or h.session_id
        return {(leg.worker_id, WorkerKeys(leg.worker_id).results(reply)) for leg in h.legs}

    def entry(self, stream: str, fields: dict[str, str]) -> dict[str, str]:
        signer = self.settings.signer
        return signer.signed(stream, fields) if signer is not None else fields

    def job(self, h: SessionHandle, hop: int, phase: Phase, start: int, tokens: tuple[int, ...], *, sample: bool = True,
            n: int = 1, session: SessionSpec | None = None, hidden: Activations | None = None,
            created_at: float | None = None, with_opening: bool = False) -> StepJob:
        return StepJob(job_id=job_id(h.session_id, hop, phase, start, h.attempt), session_id=h.session_id, hop=hop,
                       phase=phase, compat=h.legs[hop].digests[phase], start_position=start,
                       tokens=tokens, sample=sample, attempt=h.attempt, n=n, session=session, hidden=hidden,
                       reply_to=h.reply, created_at=time.time() if created_at is None else created_at,
                       with_opening=with_opening)

    def prefill_jobs(self, h: SessionHandle) -> list[StepJob]:
        """The current attempt's prefill chunks at hop 0: prompt + the generated tokens it re-feeds."""
        tokens = h.prompt + tuple(h.generated[:h.replayed_generated])
        spec = attempt_spec(h.spec, len(h.prompt), h.spec.max_tokens - h.replayed_generated)
        n, now = self.settings.prefill_chunk, time.time()
        return [self.job(h, 0, "prefill", s, tokens[s:s + n], sample=s + n >= len(tokens),
                         session=spec if s == 0 else None, created_at=now) for s in range(0, len(tokens), n)]

    def decode_job(self, h: SessionHandle, start: int, token: int | None, n: int = 1) -> StepJob:
        return self.job(h, 0, "decode", start, () if token is None else (token,), n=n)

    def push(self, batch: Batch, h: SessionHandle, job: StepJob, *, hop: int = 0, raw: bytes | None = None,
             src: str | None = None, left: int = 0) -> Sent:
        s = h.sent[job.job_id] = Sent(job, hop, raw, src, left)
        self.xadd(batch, h, s)
        return s

    def xadd(self, batch: Batch, h: SessionHandle, s: Sent) -> None:
        """The job's XADD, after the SET of its input blob when its bytes are known (same tag, same pipeline)."""
        job = s.job
        if s.raw is not None and job.hidden is not None and job.hidden.blob is not None:
            batch.add(Set(job.hidden.blob, s.raw, ex=self.settings.blob_ttl_s))
        stream = WorkerKeys(h.legs[s.hop].worker_id).input_stream(job.compat, job.phase)
        batch.add(XAdd(stream, self.entry(stream, job_to_fields(job))))

    def queue_prefill(self, batch: Batch, h: SessionHandle, *, ramp: bool = False, regenerate: bool | None = None
                      ) -> None:
        """(Re)open the session: its attempt's prefill chunks to hop 0, and its record (what resume() rebuilds it
        from: spec, prompt, attempt, the tokens this attempt re-feeds, its reply stream and where reading it stood).
        `ramp` (a session the core drives under continuation credit): its first continuation job goes with it, so it
        decodes at the call after its prefill, not one round trip later (consumer/worker/early.py).

        A replay (tokens generated before) either re-feeds them as prompt (the worker computes them one row per
        call where its recipe is batch-invariant: docs/invariance.md) or, where that recipe gives them back by
        decoding (`regenerates`), feeds the prompt alone and decodes them again: in decode calls, beside the other
        sessions' rows, not one prefill call each; each is checked as it comes (`SessionHandle.regenerate`).
        `regenerate`: the choice already made (a handle rebuilt from its record), else made here."""
        tokens = restore(h)
        if regenerate is None:
            regenerate = bool(tokens) and self.settings.regenerate and regenerates(h)
        h.regenerate, h.generated = (list(tokens), []) if regenerate else ([], tokens)
        h.replayed_generated, h.ramp = len(h.generated), ramp
        drop(h)
        for leg in h.legs:
            leg.closed = False
        h.released, h.status, h.reason, h.detail = False, "open", None, ""
        if not h.credit.n:
            h.credit.n = tokens_per_job(self, h)
        jobs = self.prefill_jobs(h)
        for job in jobs:
            self.push(batch, h, job)
        h.pending_job, h.position = jobs[-1].job_id, jobs[-1].end_position
        ramp = ramp and h.credit.n > 1 and len(h.legs) == 1 and job_n(h, h.position) >= 1
        if ramp:
            n = job_n(h, h.position)
            first = self.job(h, 0, "decode", h.position, (), n=n, with_opening=True)
            self.push(batch, h, first, left=(1 << n) - 1)
            h.credit.jobs[first.job_id] = first
            h.position = first.end_position
        record = WorkerKeys(h.worker_id).session_record(h.session_id)
        reads = {w: self.cursor(stream) for w, stream in sorted(self.streams_of(h))}
        batch.add(HSet(record, {"spec": h.spec.model_dump_json(), "prompt": ",".join(map(str, h.prompt)),
                                "hop": str(h.hop), "attempt": str(h.attempt), "decode_n": str(h.credit.n),
                                "reply": h.reply or "", "gen": ",".join(map(str, tokens)),
                                "regen": "1" if regenerate else "0", "ramp": "1" if ramp else "0",
                                "from": json.dumps(reads)}))
        batch.add(Expire(record, self.settings.record_ttl_s))

    def queue_decode(self, batch: Batch, h: SessionHandle, token: int) -> str:
        """The decode step at h.position feeding `token` (a handle driven by hand; one hop)."""
        one_hop(h)
        if h.finished:
            raise ValueError(f"session {h.session_id} is {h.status}")
        return self.push_token(batch, h, token)

    def push_token(self, batch: Batch, h: SessionHandle, token: int) -> str:
        """The decode job at h.position feeding `token` (the caller's, or the one the last hop sampled)."""
        job = self.decode_job(h, h.position, token)
        self.push(batch, h, job)
        h.pending_job, h.feed = job.job_id, False
        h.position += 1
        return job.job_id

    def queue_replay(self, batch: Batch, h: SessionHandle, *, cancel_marked: bool, regenerate: bool = True) -> None:
        """After a lost state on any hop: attempt + 1 and prompt + generated through every hop again (or the prompt,
        its tokens sampled again where `queue_prefill` chooses that; `regenerate` False: never). `cancel_marked`:
        the session's cancel marker is set: nothing is pushed, it ends cancelled. SessionFailed when max_attempts is
        spent."""
        if cancel_marked:
            end(h, "cancelled", "cancelled before the replay")
            h.reason = Reason.CANCELLED.value
            return
        # a replay that diverged (producer/session.py) was this Tracker's way, not a loss: it costs no attempt; nor
        # does placing it again after a refusal for want of a slot (producer/moves.py `place_waiting`)
        if h.attempt + 1 > self.settings.max_attempts + (1 if h.diverged else 0) + h.room_waits:
            end(h, "state_lost")
            raise SessionFailed(h)
        if len(h.generated) >= h.spec.max_tokens:
            end(h, "finished")
            return
        h.attempt += 1
        h.finished = False
        # as the session opened: with its first continuation or not
        self.queue_prefill(batch, h, ramp=h.ramp, regenerate=None if regenerate else False)

    def advance(self, batch: Batch, h: SessionHandle, replay_state_lost: bool, *, cancel_marked: bool = False) -> bool:
        """Queue what the session needs next: the next decode job at hop 0 (under credit, or the token the last
        hop sampled), the replay after a lost state (`cancel_marked`: what Redis said of its cancel marker), or
        once it ended the release of its other hops. True when something was queued."""
        if h.finished:
            return self.queue_release(batch, h)
        if h.status == "awaiting_room":  # placed again by producer/moves.py `place_waiting`, then replayed
            if h.session_id not in self.waiting:  # one wait from its first refusal: placed again, refused again
                h.room_since = h.room_since or time.monotonic()
                self.waiting[h.session_id] = h.room_since
                w = h.legs[h.waiting_hop].worker_id
                self.fleet.refused_slot[w] = self.fleet.refused_slot.get(w, 0) + 1
            return False
        if h.status == "state_lost":
            if not replay_state_lost:
                h.finished = True
                return self.queue_release(batch, h)
            try:
                self.queue_replay(batch, h, cancel_marked=cancel_marked)
            except SessionFailed:
                return self.queue_release(batch, h)
            return bool(h.sent) or self.queue_release(batch, h)
        if h.credit.n > 1:
            h.feed = False
            return queue_next(self, batch, h)
        if not h.feed:
            return False
        self.push_token(batch, h, h.generated[-1])
        return True

    def queue_release(self, batch: Batch, h: SessionHandle) -> bool:
        """An ended session: cancel it on every hop that did not close it, one hop or several (a rejected or failed
        step leaves the worker holding the session; a hop that is not last never sees a stop token). One cancel per
        worker, kept like every cancel to be sent again after an outage."""
        workers = self.release_workers(h)
        for w in workers:
            self.cancel_ops(batch, w, h.session_id)
            self.cancels.append((time.monotonic(), w, h.session_id))
        return bool(workers)

    @staticmethod
    def release_workers(h: SessionHandle) -> list[str]:
        """The workers still holding an ended (or abandoned) session, once: the handle is released by this."""
        if h.released:
            return []
        h.released = True
        workers = sorted({leg.worker_id for leg in h.legs if not leg.closed})
        for leg in h.legs:
            leg.closed = True
        return workers

    def queue_unanswered(self, batch: Batch, h: SessionHandle) -> int:
        """Re-push every job the session has unanswered at any hop (idempotent: same ids, same bytes)."""
        if h.finished or h.status == "state_lost":
            return 0
        for s in h.sent.values():
            self.xadd(batch, h, s)
        return len(h.sent)

    def cancel_ops(self, batch: Batch, worker_id: str, session_id: str) -> None:
        """The cancel on one worker: its marker (wins over a step not yet admitted) and its event. Both ids are
        checked here, before a key is built from them."""
        keys = WorkerKeys(check_id(worker_id, "worker_id"))
        sid = check_id(session_id, "session_id")
        batch.add(Set(keys.cancel_marker(sid), "1", ex=self.settings.cancel_ttl_s))
        batch.add(XAdd(keys.cancellations, self.entry(keys.cancellations, cancel_to_fields(sid)), CANCEL_MAXLEN))

    def cancel_batches(self, worker_ids: Any, session_id: str) -> list[Batch]:
        """The cancel of a session on every worker given, one transaction each (one hash tag each)."""
        out = []
        for w in dict.fromkeys(worker_ids):
            b = Batch(transaction=True, tag=w)
            self.cancel_ops(b, w, session_id)
            out.append(b)
        return out


def regenerates(h: SessionHandle) -> bool:
    """Whether a replay decodes the session's tokens again rather than re-feeding them as prompt: one hop (a
    route's hops relay rows, not tokens), a recipe that is batch-invariant (its worker samples each token again
    from the same logits: the sampler keys its draw by the session's seed and the token's position), and no
    replay of it diverged before."""
    return len(h.legs) == 1 and h.spec.route[0].key.recipe.batch_invariant and not h.diverged


def tokens_per_job(core: Steps, h: SessionHandle) -> int:
    """decode_n, capped by what the worker advertised (`max_continuation`; a worker that does not, or one not
    discovered, gets 1: it would refuse the field), and 1 on a route of several hops."""
    if core.settings.decode_n <= 1 or len(h.spec.route) != 1:
        return 1
    cached = core.discovered.get(h.worker_id)
    advertised = cached[1].info.get("max_continuation", 1) if cached is not None else 1
    if isinstance(advertised, bool) or not isinstance(advertised, int):
        return 1
    return max(1, min(core.settings.decode_n, advertised))


def queue_next(core: Steps, batch: Batch, h: SessionHandle) -> bool:
    """The session's next decode job under credit, if one is due. True when one was queued."""
    if h.pending_job is not None or not h.generated:
        return False  # the prompt's token is not known yet
    c = h.credit
    if c.jobs:
        if len(c.jobs) > 1:
            return False
        token = None  # pushed ahead: the worker feeds the token it samples there
    elif h.sent:
        return False
    else:
        token = h.generated[-1]
    n = job_n(h, h.position)
    if n < 1:
        return False  # the credit already reaches max_tokens
    job = core.decode_job(h, h.position, token, n)
    core.push(batch, h, job, left=(1 << n) - 1)
    c.jobs[job.job_id] = job
    h.position = job.end_position
    return True


def attempt_spec(spec: SessionSpec, prompt_len: int, max_tokens: int) -> SessionSpec:
    """The spec an attempt's first prefill job carries: its prompt's length and the tokens still to generate.
    A copy of the valid spec with the two fields changed (2.7 us) where they are within their own bounds (the
    model's other checks do not read them); else validated whole (26 us, `timeit`), which refuses them as ever."""
    if 1 <= prompt_len <= MAX_POSITION and 1 <= max_tokens <= MAX_GENERATE:
        return spec.model_copy(update={"prompt_len": prompt_len, "max_tokens": max_tokens})
    return SessionSpec.model_validate({**spec.model_dump(), "prompt_len": prompt_len, "max_tokens": max_tokens})
