"""A session as the Tracker drives it, and the one state machine that moves it: every answer of every hop (a
row of a result record, schemas/wire.py) goes through `apply`. A one-hop session is a route of one hop: hop 0
takes tokens, each later hop the previous hop's activations, the last one samples (docs/routes.md).

A `Run` is the sessions one run_many / generate / drive call drives. Nothing here does I/O or builds a job: what
a session needs next is producer/steps.py's business.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas import PHASES, Phase, Reason, SessionSpec, StepJob, StepResult, WorkerKeys
from schemas.activations import Activations
from schemas.step import end_job_id, result_job_id
from schemas.wire import STATUS_CODE, STATUSES, RowExtra, row_extra, row_to_result, split_result_id

if TYPE_CHECKING:
    from .placement_inputs import SessionTemplate

__all__ = ["Credit", "HopLeg", "Relay", "RouteHandle", "Run", "Sent", "SessionHandle", "Sessions", "apply",
           "apply_result", "drop", "end", "job_n", "known", "lose", "place_token", "restore"]

Sessions = Sequence[tuple["SessionSpec | SessionTemplate", Sequence[int]]]  # a template: placed first

_OK, _CANCELLED, _REJECTED, _LOST = 0, 1, 2, 3  # indexes into schemas.wire.STATUSES
# A rejection the session survives by a replay (attempt + 1, new job ids): the hop lost it, or another job was
# received under one of its job ids (a writer without the key: docs/security.md).
_REPLAYED = frozenset({Reason.UNKNOWN_SESSION, Reason.JOB_ID_CONFLICT})
# An opening refused for these never opened the session on its hop: nothing there to cancel.
_NOT_OPENED = frozenset({Reason.CAPACITY, Reason.ACCOUNT_LIMIT, Reason.INCOMPATIBLE, Reason.WRONG_HOP, Reason.BAD_TOKEN,
                         Reason.TOO_LONG, Reason.GRAMMAR_INVALID, Reason.GRAMMAR_UNSUPPORTED, Reason.CANCELLED})


@dataclass(eq=False, slots=True)
class Sent:
    """A job pushed to hop `hop` and not answered yet, kept so that a re-push (after an outage) is the same job:
    `raw` the bytes of its input blob, or `src` the output blob they were relayed from (a handle rebuilt by
    resume() does not know them). `left`: a continuation's offsets still awaited (bit k: its token k)."""

    job: StepJob
    hop: int
    raw: bytes | None = None
    src: str | None = None
    left: int = 0


@dataclass(eq=False, slots=True)
class Relay:
    """Hop `job.hop`'s answer to `job`, whose output rows (`acts`: inline, or in a blob of that hop's tag) are
    the next hop's input: relayed by route.relay, in position order."""

    job: StepJob
    acts: Activations

    @property
    def blob(self) -> str | None:
        return self.acts.blob


@dataclass(eq=False, slots=True)
class HopLeg:
    """One hop of a session's route: its compatibility key's digest per phase (its streams' names), what its
    worker charged the session and what was relayed into it."""

    hop: int
    worker_id: str
    digests: dict[str, str] = field(default_factory=dict)  # phase -> digest (computed once: sha256 of JSON)
    closed: bool = False  # it answered finished / cancelled, or was released
    engine_seconds: float = 0.0  # what this hop's worker charged the session (answers of every attempt)
    rows: int = 0  # positions it computed for the session
    bytes_in: int = 0  # activation bytes relayed into it (inline and blobs)
    blobs_in: int = 0  # of its jobs, how many took their rows from a blob


# The credit window of continuation jobs (schemas/step.py StepJob.n), one-hop sessions only (the steps that
# push them: producer/steps.py `queue_next`).
#
# With `decode_n > 1` a session's decode steps are jobs of up to n tokens; the worker decodes the session at every
# decode call and answers one row per token. Two jobs are kept outstanding: as soon as only one is, the next is
# pushed (a *continuation*: no token, it starts where the last one ends and feeds the token the worker sampled
# there). So the worker holds at least n tokens of credit whenever the Tracker acts, and a Tracker slower than n
# fused calls between two reads (a slow callback) is the only one a session ever waits for.
# What a job asks for depends only on where it starts (`job_n`, never past max_tokens), so a handle rebuilt by
# resume() pushes the same jobs (same ids, same n). A stop token ends the session early: the credit left is
# dropped (the worker answers a continuation queued behind it REJECTED FINISHED, no token, no charge).
@dataclass(eq=False, slots=True)
class Credit:
    """n: tokens per decode job, fixed when the session opens (kept in its record: a resumed handle follows the
    same jobs; 0: not fixed yet). jobs: the continuation jobs not ended, in position order. early: tokens that
    arrived ahead of a missing one (after Redis lost some answers a worker re-sends them behind newer ones), by
    position: (token, finished)."""

    n: int = 0
    jobs: dict[str, StepJob] = field(default_factory=dict)
    early: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def clear(self) -> None:
        self.jobs.clear()
        self.early.clear()


@dataclass(eq=False, repr=False)
class SessionHandle:
    """One session. `status`: "open" while it runs, "finished" when its last hop said finished, else what ended
    it ("rejected", "failed", "cancelled"), or "state_lost" (not finished: `replay()` it), or "awaiting_room" (not
    finished: a placed session a worker refused a slot, placed again by producer/moves.py). `generated`: the
    tokens so far; `position`: the next position to push at hop 0; `reply`: the result stream its jobs name
    (`reply_to`, a Tracker id; None: the session's own). `legs[k]`: hop k; `prompt_tokens` / `billed_generated`
    / `cached_tokens`: what the last hop charged it (the counters' charges; cached: a part of prompt_tokens)."""

    spec: SessionSpec
    prompt: tuple[int, ...]
    worker_id: str  # hop 0's
    reply: str | None = None
    legs: list[HopLeg] = field(default_factory=list)
    position: int = 0
    generated: list[int] = field(default_factory=list)
    attempt: int = 0
    finished: bool = False
    status: str = "open"
    reason: str | None = None
    detail: str = ""
    pending_job: str | None = None  # hop 0's sampling job whose token is awaited
    hop: int = 0
    last_result_id: str = "0-0"  # the last result entry that moved it
    replayed_generated: int = 0  # generated tokens re-fed by the current attempt's prefill
    # A replay that decodes its tokens again (a one-hop session on a batch-invariant recipe: producer/steps.py
    # `queue_prefill`): the tokens the caller had, which the attempt must sample again, in order. `generated` is
    # rebuilt by the attempt from []; each token it places below len(regenerate) must equal the one there (else
    # the replay diverged: replayed again the exact way, `diverged`), and is not the caller's news (`echo`).
    regenerate: list[int] = field(default_factory=list)
    # the last answer applied is not the caller's news, not passed on: a token it had, decoded again, or one that
    # differs from it there (the attempt is lost: `diverged`)
    echo: bool = False
    diverged: bool = False  # a regenerated token differed: later replays re-feed the tokens as prompt
    ramp: bool = False  # its opening pushes its first continuation with it (producer/steps.py): so does a replay
    credit: Credit = field(default_factory=Credit)
    sent: dict[str, Sent] = field(default_factory=dict)  # every hop's unanswered jobs, by job id
    relays: list[Relay] = field(default_factory=list)  # answers whose rows wait to be relayed
    released: bool = False
    prompt_tokens: int = 0
    billed_generated: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the last hop restored from its prefix cache
    feed: bool = False  # the last hop sampled a token hop 0 has not been given
    run: Any = None  # the core.Run driving it; None: driven by hand, its answers kept in `inbox`
    inbox: list[StepResult] = field(default_factory=list)
    last_row: Any = None  # (record, charges, row) or a StepResult: `last_result`
    template: Any = None  # the SessionTemplate it was placed from (it may move: producer/moves.py); None: named
    # A placed session whose opening a worker refused for want of a slot waits for room (status "awaiting_room"):
    # the hop refused. `room_waits`: the attempts that placed it again so (they cost no max_attempts). `carried`:
    # the charged high-water mark a move gave its new hops (producer/moves.py), carried again when it is placed anew.
    waiting_hop: int = 0
    room_waits: int = 0
    room_since: float = 0.0  # monotonic time of the first refusal since its last answer ok (0: none)
    carried: Any = None

    def __post_init__(self) -> None:
        if not self.legs:
            self.legs = [HopLeg(k, rh.worker_id, {p: rh.key.for_phase(p).digest for p in PHASES})
                         for k, rh in enumerate(self.spec.route)]

    def __repr__(self) -> str:  # short: a handle holds its spec, its jobs and its Run
        return (f"SessionHandle({self.session_id!r}, {self.status}, {len(self.generated)} tokens, attempt "
                f"{self.attempt}, {len(self.legs)} hop{'s' if len(self.legs) > 1 else ''})")

    @property
    def session_id(self) -> str:
        return self.spec.session_id

    def input_stream(self, phase: Phase, hop: int = 0) -> str:
        leg = self.legs[hop]
        return WorkerKeys(leg.worker_id).input_stream(leg.digests[phase], phase)

    @property
    def awaits_replay(self) -> bool:
        """Its state was lost and it is not finished: the next step is a replay (or a cancel)."""
        return self.status == "state_lost" and not self.finished

    @property
    def jobs(self) -> set[str]:
        """The result ids still awaited (a continuation's: one per token, and its ending answer)."""
        out: set[str] = set()
        for jid, s in self.sent.items():
            if s.job.n > 1:
                out.update(result_job_id(jid, k) for k in range(s.job.n) if s.left >> k & 1)
                out.add(end_job_id(jid))
            else:
                out.add(jid)
        return out

    @property
    def last_result(self) -> StepResult | None:
        r = self.last_row
        return row_to_result(*r) if isinstance(r, tuple) else r


@dataclass(eq=False, repr=False)
class Run:
    """The sessions one run_many / generate / drive call drives: those still to open (by start time, seconds
    from the call), the handles, the answers for its callbacks (`collect`). `waker`: the driver's."""

    sessions: Sessions
    times: list[float]
    replay: bool = True
    collect: bool = False
    handles: dict[str, SessionHandle] = field(default_factory=dict)
    results: list[tuple[SessionHandle, StepResult]] = field(default_factory=list)
    live: int = 0
    error: BaseException | None = None
    waker: Any = None  # the driver's (AsyncProducer: an asyncio.Event)
    pending: deque[int] = field(default_factory=deque)

    def due(self, elapsed: float) -> list[int]:
        out = []
        while self.pending and self.times[self.pending[0]] <= elapsed:
            out.append(self.pending.popleft())
        return out

    def until_next(self, elapsed: float) -> float | None:
        return max(0.0, self.times[self.pending[0]] - elapsed) if self.pending else None

    @property
    def done(self) -> bool:
        return not self.pending and not self.live

    def take(self) -> list[tuple[SessionHandle, StepResult]]:
        out, self.results = self.results, []
        return out

    def out(self) -> dict[str, SessionHandle]:
        """The handles: resumed ones first, then in the order given."""
        order = [s.session_id for s, _ in self.sessions]
        given = set(order)
        return {**{k: h for k, h in self.handles.items() if k not in given},
                **{k: self.handles[k] for k in order if k in self.handles}}


RouteHandle = SessionHandle  # a session on a route of one or more hops: one class


def lose(h: SessionHandle) -> None:
    """Its state is gone on some hop: nothing of the current attempt is awaited any more (replay or end)."""
    h.status = "state_lost"
    drop(h)
    restore(h)


def end(h: SessionHandle, status: str, detail: str | None = None) -> None:
    h.finished, h.status = True, status
    if detail is not None:
        h.detail = detail
    drop(h)
    restore(h)


def known(h: SessionHandle) -> list[int]:
    """The session's tokens as its caller had them: `generated`, or, while an attempt that decodes them again is
    not through them yet, the longer list it is rebuilding (`generated` a prefix of it: each was checked when
    placed). Reads only: the attempt goes on."""
    return h.regenerate if len(h.generated) < len(h.regenerate) else h.generated


def restore(h: SessionHandle) -> list[int]:
    """The attempt stopped (it ended, was lost, or its driver gave up): `generated` is set back to `known(h)`."""
    tokens = known(h)
    if tokens is not h.generated:
        h.generated = list(tokens)
    return h.generated


def _diverged(h: SessionHandle, pos: int, tok: int) -> bool:
    """A token the attempt decodes again (at `pos`, below what the caller had) is checked and flagged `echo` (not
    the caller's news); when it differs, the attempt is lost (replayed feeding the tokens as prompt, `diverged`)
    and True is returned."""
    i = pos - len(h.prompt)
    if i >= len(h.regenerate):
        return False
    if h.regenerate[i] == tok:
        h.echo = True
        return False
    h.diverged = True
    h.echo = True  # not the caller's token: it has its own there, and the next attempt gives that one again
    h.detail = f"the replay sampled {tok} at position {pos} where the session had {h.regenerate[i]}"
    lose(h)
    return True


def drop(h: SessionHandle) -> None:
    """Nothing of the current attempt is awaited any more."""
    h.feed, h.pending_job = False, None
    h.relays.clear()
    h.sent.clear()
    h.credit.clear()


def apply(h: SessionHandle, s: Sent, off: int, st: int, pos: int, tok: int, fin: int, x: RowExtra | None,
          es: float, charged_p: int, charged_g: int, charged_k: int = 0) -> bool:
    """One answer to the session's job `s` (a row: offset, status code, position, token or -1, finished, extra,
    engine seconds, what the counters charged). False when it changes nothing (a token already placed).
    `h.echo`: set when the answer is not the caller's news (a replay decoding a token the caller had, the same or
    another)."""
    job = s.job
    h.echo = False
    if job.n > 1 and st == _OK:  # a continuation: one answer per token, then the job has ended
        bit = 1 << off if off >= 0 else 0
        if not s.left & bit:
            return False
        s.left &= ~bit
    if job.n == 1 or st != _OK or not s.left:
        del h.sent[job.job_id]
        h.credit.jobs.pop(job.job_id, None)
    leg = h.legs[s.hop]
    leg.engine_seconds += es
    if st != _OK:
        reason = x.reason if x is not None else None
        h.reason = reason.value if reason is not None else None
        detail = x.detail if x is not None else ""
        h.detail = f"hop {s.hop}: {detail}" if len(h.legs) > 1 else detail
        if st == _REJECTED and reason == Reason.CAPACITY and h.template is not None and h.run is not None \
                and job.phase == "prefill" and job.start_position == 0:
            # A placed session's opening refused for a slot (the fleet is full, or the worker fuller than the
            # Tracker saw): it waits for room and is placed again (producer/moves.py `place_waiting`), not ended.
            # Not its caller's news: the session goes on. (Driven by a Run: a handle driven by hand ends here.)
            leg.closed = True  # never opened there
            h.status, h.waiting_hop, h.echo = "awaiting_room", s.hop, True
            drop(h)
            restore(h)
            return True
        if st == _LOST or (st == _REJECTED and reason in _REPLAYED):
            # The hop that lost the session holds nothing to cancel; one that refused another job under
            # this session's id (job_id_conflict) still holds it (the replay supersedes it there).
            leg.closed = leg.closed or st == _LOST or reason == Reason.UNKNOWN_SESSION
            lose(h)
        else:
            leg.closed = leg.closed or st == _CANCELLED or (
                st == _REJECTED and reason in _NOT_OPENED and job.phase == "prefill" and job.start_position == 0)
            end(h, STATUSES[st].value)
        return True
    h.room_since = 0.0  # open somewhere: a later refusal starts a new wait for room
    leg.rows += len(job.tokens) if job.n == 1 else 1
    if s.hop != len(h.legs) - 1:  # rows for the next hop
        hidden = x.hidden if x is not None else None
        leg.closed = leg.closed or fin == 1  # this hop counts max_tokens itself
        if hidden is None:
            end(h, "failed", f"hop {s.hop} answered without activations")
        elif hidden.rows != len(job.tokens):
            end(h, "failed", f"hop {s.hop} answered {hidden.rows} rows for {len(job.tokens)} tokens")
        else:
            h.relays.append(Relay(job, hidden))
        return True
    h.prompt_tokens += charged_p
    h.cached_tokens += charged_k
    h.billed_generated += charged_g
    if job.n > 1:
        finished = place_token(h, pos, tok, fin == 1)
    elif job.sample:
        if tok < 0:
            end(h, "failed", "the last hop's sampling answer carried no token")
            return True
        if h.regenerate and _diverged(h, pos, tok):
            return True
        h.generated.append(tok)
        h.pending_job, h.feed = None, True
        finished = fin == 1
    else:
        finished = fin == 1
    if finished:
        leg.closed = True
        end(h, "finished")
    return True


def apply_result(h: SessionHandle, r: StepResult) -> bool:
    """Apply an answer built in memory (a test double of a worker, tests/test_continuation.py) as a row read from
    a record would be. False (ignored) when it answers no current job of the session."""
    job, off = split_result_id(r.job_id)
    s = h.sent.get(job)
    if s is None or r.session_id != h.session_id:
        return False
    a, x = r.accounting, row_extra(r)
    if not apply(h, s, off, STATUS_CODE[r.status], r.position, -1 if r.token is None else r.token, int(r.finished),
                 x, a.engine_seconds, a.prompt_tokens, a.generated_tokens, a.cached_tokens):
        return False
    h.last_row = r
    return True


def job_n(h: SessionHandle, start: int) -> int:
    """Tokens the job starting at `start` asks for: n, cut so that the session's last token (number max_tokens,
    at position len(prompt) + max_tokens - 1) is the last one asked for. <= 0: none left."""
    return min(h.credit.n, len(h.prompt) + h.spec.max_tokens - 1 - start)


def place_token(h: SessionHandle, pos: int, tok: int, finished: bool) -> bool:
    """Put a continuation's token in its place: a row's position is the session's next one, so token i (0: the
    prompt's) has position len(prompt) + i. Appended in position order; one ahead of a missing one waits in
    `early` (never appended out of order: that would corrupt the text silently). True when the session's
    finishing token is now in place."""
    if tok < 0:
        return False
    if h.regenerate and _diverged(h, pos, tok):
        return False
    early = h.credit.early
    early[pos] = (tok, finished)
    done = False
    nxt = len(h.prompt) + len(h.generated)
    while nxt in early:
        t, f = early.pop(nxt)
        h.generated.append(t)
        done = done or f
        nxt += 1
    return done
