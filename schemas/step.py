"""Step jobs (Tracker -> worker) and step results (worker -> Tracker).

Both are msgspec Structs: the per-token path (a worker reading jobs, a Tracker reading results) builds
and parses them without a validation library; the strict codec is schemas/wire.py. A job's values are
checked once, in `StepJob.__post_init__`, whether the job was decoded from the wire or built by a
producer. The session's spec (`SessionSpec`, once per session) stays a pydantic model: an edge.
"""

from __future__ import annotations

import math
import re
from typing import Final

import msgspec

from .activations import Activations
from .compat import Phase
from .limits import (
    MAX_CONTINUATION,
    MAX_ID_LEN,
    MAX_POSITION,
    MAX_TOKEN_ID,
    MAX_TOKENS_PER_JOB,
    WIRE_VERSION,
    is_id,
)
from .reasons import Reason, Status
from .session import SessionSpec

__all__ = [
    "END_OFFSET", "MAX_CONTINUATION_JOB_ID", "Accounting", "Reason", "Status", "StepJob", "StepResult", "end_job_id",
    "result_job_id", "row_result_id", "split_result_id",
]

# A continuation job's result ids append a suffix to its job id: ".<offset>" (offset >= 1) for its
# tokens, ".end" for the one answer that ends it without a token. The job id must leave room for it.
_END_SUFFIX: Final = ".end"
END_OFFSET: Final = -1  # a result row's `off` for a continuation's ending answer (result id `<job>.end`)
MAX_CONTINUATION_JOB_ID: Final = MAX_ID_LEN - len(_END_SUFFIX)
_COMPAT: Final = re.compile(r"[0-9a-f]{16}")
_PHASES: Final = ("prefill", "decode")


def result_job_id(job_id: str, offset: int) -> str:
    """The result id of a job's token number `offset` (0-based). Offset 0 keeps the job's own id, so a
    job with n = 1 is answered exactly as before continuation jobs existed. Deterministic, so a
    redelivery or a replay of the job writes the same result ids."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    return job_id if offset == 0 else f"{job_id}.{offset}"


def end_job_id(job_id: str) -> str:
    """The result id of the one answer that ends a continuation job (n > 1) without a token: a
    cancellation, state_lost, a rejection, a failure. Distinct from every token's id, so an answer
    after some tokens were published (a crash mid-job, then state_lost on redelivery) is never
    swallowed by the record of the job's first token."""
    return job_id + _END_SUFFIX


def row_result_id(job_id: str, off: int) -> str:
    """A row's result id from its `job` and `off` columns: the one formatting of a result id (the
    reverse of `split_result_id`)."""
    return end_job_id(job_id) if off == END_OFFSET else result_job_id(job_id, off)


def split_result_id(result_id: str, job_id: str | None = None) -> tuple[str, int]:
    """A result id's job id and row offset (`job`, `off` columns): `<job>` -> 0, `<job>.<k>` -> k,
    `<job>.end` -> END_OFFSET. With `job_id` known (the worker, which answers its own job) the suffix is
    read after it exactly; without, after the last `.` (a job id may hold dots: the answer of an id
    `a.3` built in memory is read as token 3 of job `a`, as it always was). ValueError when `result_id`
    is not `job_id`'s."""
    if job_id is not None:
        if result_id == job_id:
            return job_id, 0
        if not result_id.startswith(job_id + "."):
            raise ValueError(f"result id {result_id[:80]!r} is not job {job_id[:80]!r}'s")
        suffix = result_id[len(job_id) + 1:]
        return job_id, END_OFFSET if suffix == _END_SUFFIX[1:] else int(suffix)
    base, _, suffix = result_id.rpartition(".")
    if base and suffix == _END_SUFFIX[1:]:
        return base, END_OFFSET
    if base and suffix.isdigit():
        return base, int(suffix)
    return result_id, 0


def _int_in(value: object, lo: int, hi: int) -> bool:
    return type(value) is int and lo <= value <= hi


class StepJob(msgspec.Struct, frozen=True, kw_only=True):
    """One step of one session on one hop: a prefill chunk, or a decode step of up to `n` tokens.

    The first prefill chunk (start_position 0) carries the SessionSpec, which opens the session on the
    worker. `sample` asks for a token back: set on the last prefill chunk and on every decode step.
    `compat` is the digest of the compatibility key the producer meant; the consumer re-checks it
    against the stream it arrived on and its engine. `reply_to` names the result stream the answers go
    to (`WorkerKeys.results(reply_to)`, one per Tracker: docs/wire-format.md); None: the session's own.

    Continuation (docs/wire-format.md): a decode job with `n > 1` asks for up to n tokens. The worker
    feeds its token at start_position, then each token it samples at the next position, one per
    decode call, answering each under `result_job_id(job_id, offset)`, until n tokens, a stop token,
    max_tokens or a cancellation. A decode job with no token (`tokens == ()`) continues from the
    session's own last sampled token (a continuation pushed ahead, before the producer knows it):
    it starts where the previous job's tokens end (`end_position`), which the worker checks.
    `with_opening`: such a job pushed together with its session's opening (the first continuation, at the
    prompt's end): a worker that reads it before the prompt holds it until the prompt is queued
    (consumer/worker/early.py) instead of answering it for a session it does not hold.

    Every value is checked in `__post_init__` (ValueError / TypeError), built or decoded alike.
    """

    job_id: str
    session_id: str
    phase: Phase
    compat: str
    start_position: int
    tokens: tuple[int, ...]
    created_at: float
    hop: int = 0
    sample: bool = True
    attempt: int = 0
    session: SessionSpec | None = None
    # The input activations, one row per token: present exactly when the target hop consumes hidden
    # (the worker checks that against its boundary schema; tokens still name the session's tokens).
    hidden: Activations | None = None
    n: int = 1  # tokens asked for (decode only; 1: one step)
    reply_to: str | None = None
    with_opening: bool = False

    def __post_init__(self) -> None:
        if type(self.tokens) is not tuple:
            msgspec.structs.force_setattr(self, "tokens", tuple(self.tokens))
        problem = self._problem()
        if problem is not None:
            raise ValueError(problem)

    def _problem(self) -> str | None:
        if not is_id(self.job_id):
            return "job_id is not an id (docs/wire-format.md)"
        if not is_id(self.session_id):
            return "session_id is not an id"
        if self.phase not in _PHASES:
            return "phase is not 'prefill' or 'decode'"
        if type(self.compat) is not str or not _COMPAT.fullmatch(self.compat):
            return "compat is not 16 lowercase hex digits"
        if not _int_in(self.start_position, 0, MAX_POSITION):
            return f"start_position is not an int in [0, {MAX_POSITION}]"
        toks = self.tokens
        if len(toks) > MAX_TOKENS_PER_JOB:
            return f"more than {MAX_TOKENS_PER_JOB} tokens"
        # in C: a generator resumed per token took 31 us of a 512-token prefill job (built by the Tracker, decoded
        # by the worker), the types counted 13 (`timeit`, a host about 2x slow)
        if toks and (list(map(type, toks)).count(int) != len(toks) or min(toks) < 0 or max(toks) > MAX_TOKEN_ID):
            return f"tokens must be ints in [0, {MAX_TOKEN_ID}]"
        if type(self.created_at) not in (float, int) or not math.isfinite(self.created_at) or self.created_at < 0:
            return "created_at must be a finite number >= 0"
        if not _int_in(self.hop, 0, 15):
            return "hop must be an int in [0, 15]"
        if type(self.sample) is not bool:
            return "sample must be a bool"
        if type(self.with_opening) is not bool:
            return "with_opening must be a bool"
        if not _int_in(self.attempt, 0, 1000):
            return "attempt must be an int in [0, 1000]"
        if not _int_in(self.n, 1, MAX_CONTINUATION):
            return f"n must be an int in [1, {MAX_CONTINUATION}]"
        if self.reply_to is not None and not is_id(self.reply_to):
            return "reply_to is not an id"
        if self.session is not None and not isinstance(self.session, SessionSpec):
            return "session must be a SessionSpec"
        if self.hidden is not None and not isinstance(self.hidden, Activations):
            return "hidden must be an Activations header"
        return self._consistency()

    def _consistency(self) -> str | None:
        if self.hidden is not None and self.hidden.rows != len(self.tokens):
            return f"hidden has {self.hidden.rows} rows for {len(self.tokens)} tokens"
        if self.phase == "prefill" and not self.tokens:
            return "a prefill chunk carries tokens (at least one)"
        if self.phase == "decode" and len(self.tokens) > 1:
            return "a decode step carries exactly one token (or none: the session's own last one)"
        if self.phase != "decode" and self.n != 1:
            return "only a decode job asks for n > 1 tokens"
        if self.n > 1 and len(self.job_id) > MAX_CONTINUATION_JOB_ID:
            return f"a job with n > 1 has a job id of at most {MAX_CONTINUATION_JOB_ID} characters"
        if self.phase == "decode" and not self.sample:
            return "a decode step always samples"
        if self.with_opening and (self.phase != "decode" or self.tokens or self.hop):
            return "with_opening marks a token-less decode job of hop 0"
        if self.session is not None and self.session.session_id != self.session_id:
            return "session.session_id differs from session_id"
        if (self.phase == "prefill" and self.start_position == 0) != (self.session is not None):
            return "the SessionSpec travels exactly with the opening prefill (start_position 0)"
        return None

    @property
    def v(self) -> int:
        return WIRE_VERSION

    @property
    def end_position(self) -> int:
        """Where the next job of the session starts: after the prefill chunk's tokens, or after the n
        positions a decode job feeds (its last sampled token goes there)."""
        if self.phase == "decode":
            return self.start_position + self.n
        return self.start_position + len(self.tokens)

    @property
    def reply(self) -> str:
        """The result stream suffix the answers go to: `reply_to`, else the session id."""
        return self.reply_to if self.reply_to is not None else self.session_id

    def answer_id(self, offset: int, ok: bool, duplicate: bool = False) -> str:
        """The result id of this job's answer: token number `offset` when ok; for a job with n > 1 an
        answer that ends it without a token takes `end_job_id` (a DUPLICATE keeps the job id: the
        record of its first answer stands). A job with n = 1 always answers under its own id."""
        if ok:
            return result_job_id(self.job_id, offset)
        return end_job_id(self.job_id) if self.n > 1 and not duplicate else self.job_id

    def replace(self, **changes: object) -> StepJob:
        """A copy with some fields changed, checked again."""
        return msgspec.structs.replace(self, **changes)


class Accounting(msgspec.Struct, frozen=True, kw_only=True):
    """What one answer charged: `prompt_tokens` and `generated_tokens` are what the worker's counters
    charged for it (docs/accounting.md: each prompt position and each sampled token once per session),
    `recomputed_tokens` the positions it re-computed and did not charge (a replay), `engine_seconds`
    its share of its fused calls, `cached_tokens` those of its `prompt_tokens` the worker restored from
    its prefix cache instead of computing them (a part of `prompt_tokens`, not an addition: OpenAI's
    `usage.prompt_tokens_details.cached_tokens`). A duplicate publication of an answer charges nothing."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    recomputed_tokens: int = 0
    engine_seconds: float = 0.0
    cached_tokens: int = 0

    @property
    def tokens_charged(self) -> int:
        return self.prompt_tokens + self.generated_tokens


_NO_CHARGE: Final = Accounting()


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Log-probabilities of a sampled token (`Sampling.logprobs`: docs/sampling.md): `lp` the chosen
    token's, from the raw row (before the session's controls, as llama.cpp's `n_probs` and vLLM's
    `logprobs` report); `top` the most likely ids with theirs, most likely first (up to the N asked; ids
    of probability 0 are left out)."""

    lp: float
    top: tuple[tuple[int, float], ...] = ()


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """One step's answer as a Tracker reads it: one row of a result record (schemas/wire.py)."""

    job_id: str
    session_id: str
    status: Status
    position: int  # the session's next position after this step
    worker_id: str
    reason: Reason | None = None
    detail: str = ""
    token: int | None = None
    finished: bool = False  # max_tokens or a stop token reached: the worker released the session
    accounting: Accounting = _NO_CHARGE
    batch_size: int = 0  # sessions in the fused call that served it
    # A non-last hop's OK answer: its output activations, one row per token of the job (no token).
    hidden: Activations | None = None
    logprobs: TokenLogprobs | None = None  # with a token, when the session asked (Sampling.logprobs)
    # The fused calls the job's prompt positions were computed in: more than one when chunked prefill split
    # them (the worker's prefill budget); 0 for an answer of no prefill call. A record's optional column.
    prefill_calls: int = 0

    def __post_init__(self) -> None:
        if (self.status == Status.OK) != (self.reason is None):
            raise ValueError("a reason is given exactly when status is not ok")
        if self.hidden is not None and (self.status != Status.OK or self.token is not None):
            raise ValueError("activations come only with an OK answer that sampled no token")
