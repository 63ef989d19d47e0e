"""The credit window of continuation jobs (schemas/step.py StepJob.n), one-hop sessions only.

With `decode_n > 1` a session's decode steps are jobs of up to n tokens; the worker decodes the session at every
decode call and answers one row per token. Two jobs are kept outstanding: as soon as only one is, the next is
pushed (a *continuation*: no token, it starts where the last one ends and feeds the token the worker sampled
there). So the worker holds at least n tokens of credit whenever the Tracker acts, and a Tracker slower than n
fused calls between two reads (a slow callback) is the only one a session ever waits for.
What a job asks for depends only on where it starts (`job_n`, never past max_tokens), so a handle rebuilt by
resume() pushes the same jobs (same ids, same n). A stop token ends the session early: the credit left is
dropped (the worker answers a continuation queued behind it REJECTED FINISHED, no token, no charge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schemas import StepJob

if TYPE_CHECKING:
    from .commands import Batch
    from .session import SessionHandle
    from .steps import Steps

__all__ = ["Credit", "job_n", "place", "queue_next", "tokens_per_job"]


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


def job_n(h: SessionHandle, start: int) -> int:
    """Tokens the job starting at `start` asks for: n, cut so that the session's last token (number max_tokens,
    at position len(prompt) + max_tokens - 1) is the last one asked for. <= 0: none left."""
    return min(h.credit.n, len(h.prompt) + h.spec.max_tokens - 1 - start)


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


def place(h: SessionHandle, pos: int, tok: int, finished: bool) -> bool:
    """Put a continuation's token in its place: a row's position is the session's next one, so token i (0: the
    prompt's) has position len(prompt) + i. Appended in position order; one ahead of a missing one waits in
    `early` (never appended out of order: that would corrupt the text silently). True when the session's
    finishing token is now in place."""
    if tok < 0:
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
