"""The producer's credit window for continuation jobs (schemas/step.py StepJob.n).

With `decode_n > 1` a session's decode steps are jobs of up to `decode_n` tokens each. The worker
decodes such a session at every decode call and publishes one result per token (ids
`result_job_id(job_id, offset)`); the producer keeps the session in credit: once no more than half of a
job's tokens are still to come, it pushes the next job (a *continuation*: no token, it starts where the
current one ends, `StepJob.end_position`, and feeds the token the worker sampled there), so the session
never waits on the Tracker between jobs. At most two jobs are outstanding.

What a job asks for depends only on where it starts (`job_n`): never past the session's max_tokens, so
a session that reaches max_tokens leaves no credit behind, and a handle rebuilt by `resume()`, which
decides at other moments, pushes the same jobs (same ids, same n). A stop token ends the session early:
the rest of the credit is dropped (the worker answers a continuation queued behind it REJECTED FINISHED,
with no token and no charge; the handle, finished, ignores it). A route of several hops keeps n = 1
(each token travels back to hop 0): the worker refuses n > 1 there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schemas import StepJob, StepResult
from schemas.step import result_job_id

if TYPE_CHECKING:
    from .core import Batch, ProducerCore, SessionHandle

__all__ = ["Credit", "job_n", "on_ok", "place", "queue_continuation", "queue_next", "requeue", "tokens_per_job"]


@dataclass
class Credit:
    """A handle's continuation jobs pushed and not ended, and the token results still awaited."""

    jobs: dict[str, StepJob] = field(default_factory=dict)  # job id -> job, in position order
    tokens: dict[str, str] = field(default_factory=dict)  # awaited token result id -> its job id
    left: dict[str, int] = field(default_factory=dict)  # job id -> its tokens still awaited
    # Tokens per decode job, fixed when the session opens (tokens_per_job) and kept in its record, so a
    # handle rebuilt by resume() follows the same jobs. 0: not fixed yet.
    n: int = 0
    # Token results that arrived ahead of a token still missing, by the session position they name. A
    # continuation's tokens can arrive out of order: after Redis lost some results, the worker re-sends
    # them when the job is pushed again, behind newer ones.
    early: dict[int, StepResult] = field(default_factory=dict)

    def clear(self) -> None:
        self.jobs.clear()
        self.tokens.clear()
        self.left.clear()
        self.early.clear()


def tokens_per_job(core: ProducerCore, h: SessionHandle) -> int:
    """The n of the session's decode jobs: decode_n, capped by what its worker advertised
    (`max_continuation` in its info; a worker that does not advertise it, or one not discovered, gets
    n = 1: it would refuse the field), and 1 on a route of several hops."""
    if core.decode_n <= 1 or len(h.spec.route) != 1:
        return 1
    cached = core.discovered.get(h.worker_id)
    advertised = cached[1].info.get("max_continuation", 1) if cached is not None else 1
    if isinstance(advertised, bool) or not isinstance(advertised, int):
        return 1
    return max(1, min(core.decode_n, advertised))


def job_n(h: SessionHandle, start: int, decode_n: int) -> int:
    """Tokens the job starting at `start` asks for: decode_n, cut so the session's last token (number
    max_tokens, at position len(prompt) + max_tokens - 1) is the last one asked for. <= 0: none left."""
    return min(decode_n, len(h.prompt) + h.spec.max_tokens - 1 - start)


def queue_continuation(core: ProducerCore, batch: Batch, h: SessionHandle, token: int | None, n: int) -> str:
    """Push a decode job of n tokens at h.position (feeding `token`, or with none: the session's own last
    sampled token) and await its token results; returns its job id."""
    from .core import job_id  # the one job id rule (the core imports this module)

    key = h.spec.route[h.hop].key.for_phase("decode")
    start = h.position
    jid = job_id(h.session_id, h.hop, "decode", start, h.attempt)
    job = StepJob(job_id=jid, session_id=h.session_id, hop=h.hop, phase="decode", compat=key.digest,
                  start_position=start, tokens=() if token is None else (token,), sample=True,
                  attempt=h.attempt, created_at=time.time(), n=n)
    core._push(batch, h, job)
    c = h.credit
    c.jobs[jid] = job
    c.left[jid] = n
    for k in range(n):
        rid = result_job_id(jid, k)
        c.tokens[rid] = jid
        h.jobs.add(rid)
    h.jobs.add(job.answer_id(0, ok=False))  # its ending answer without a token (cancel, state_lost, ...)
    h.position = job.end_position
    return jid


def queue_next(core: ProducerCore, batch: Batch, h: SessionHandle, decode_n: int) -> bool:
    """The session's next decode job under credit (jobs of up to decode_n tokens), if one is due. True
    when one was queued."""
    if h.pending_job is not None or not h.generated:
        return False  # the prompt's token is not known yet
    c = h.credit
    if not c.jobs:
        if h.jobs:
            return False
        n = job_n(h, h.position, decode_n)
        if n < 1:
            return False
        queue_continuation(core, batch, h, h.generated[-1], n)  # the token is known: carry it
        return True
    if len(c.jobs) > 1 or len(c.tokens) > max(1, decode_n // 2):
        return False
    n = job_n(h, h.position, decode_n)
    if n < 1:
        return False  # the credit already reaches max_tokens
    queue_continuation(core, batch, h, None, n)
    return True


def on_ok(h: SessionHandle, r: StepResult) -> bool:
    """An ok result of the handle (already taken out of h.jobs): True when it is one of its continuation
    jobs' tokens. A job whose last token arrived has ended: its ending id is no longer awaited."""
    c = h.credit
    jid = c.tokens.pop(r.job_id, None)
    if jid is None:
        return False
    c.left[jid] -= 1
    if c.left[jid] == 0:
        del c.left[jid]
        job = c.jobs.pop(jid)
        h.jobs.discard(job.answer_id(0, ok=False))
    return True


def place(h: SessionHandle, r: StepResult) -> bool:
    """Put a continuation's token result in its place: a result's position is the session's next one,
    so token number i (0: the prompt's) has position len(prompt) + i. Tokens are appended in position
    order; one ahead of a missing one waits in `early` (never appended out of order: that would corrupt
    the text silently). True when the session's finishing token is now in place."""
    c = h.credit
    if r.token is None:
        return False
    c.early[r.position] = r
    finished = False
    nxt = len(h.prompt) + len(h.generated)
    while nxt in c.early:
        q = c.early.pop(nxt)
        assert q.token is not None
        h.generated.append(q.token)
        finished = finished or q.finished
        nxt += 1
    return finished


def requeue(core: ProducerCore, batch: Batch, h: SessionHandle) -> int:
    """Re-push the continuation jobs not ended (idempotent: same job ids). Returns how many."""
    for job in h.credit.jobs.values():
        core._push(batch, h, job)
    return len(h.credit.jobs)
