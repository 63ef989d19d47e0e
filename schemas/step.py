"""Step jobs (Tracker -> worker) and step results (worker -> Tracker)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .activations import Activations
from .compat import Phase
from .limits import (
    ID_PATTERN,
    MAX_CONTINUATION,
    MAX_ID_LEN,
    MAX_POSITION,
    MAX_REASON_LEN,
    MAX_TOKEN_ID,
    MAX_TOKENS_PER_JOB,
    SCHEMA_VERSION,
)
from .session import SessionSpec

Id = Field(pattern=ID_PATTERN)

# A continuation job's result ids append a suffix to its job id: ".<offset>" (offset >= 1) for its
# tokens, ".end" for the one answer that ends it without a token. The job id must leave room for it.
_END_SUFFIX = ".end"
MAX_CONTINUATION_JOB_ID = MAX_ID_LEN - len(_END_SUFFIX)


def result_job_id(job_id: str, offset: int) -> str:
    """The result id of a job's token number `offset` (0-based). Offset 0 keeps the job's own id, so a
    job with n = 1 is answered exactly as before continuation jobs existed. Deterministic, so a
    redelivery or a replay of the job writes the same result records (the worker's SET NX dedupes)."""
    if offset < 0:
        raise ValueError(f"offset must be >= 0, not {offset}")
    return job_id if offset == 0 else f"{job_id}.{offset}"


def end_job_id(job_id: str) -> str:
    """The result id of the one answer that ends a continuation job (n > 1) without a token: a
    cancellation, state_lost, a rejection, a failure. Distinct from every token's id, so an answer
    after some tokens were published (a crash mid-job, then state_lost on redelivery) is never
    swallowed by the record of the job's first token."""
    return job_id + _END_SUFFIX


class StepJob(BaseModel):
    """One step of one session on one hop: a prefill chunk, or a decode step of up to `n` tokens.

    The first prefill chunk (start_position 0) carries the SessionSpec, which opens the session on the
    worker. `sample` asks for a token back: set on the last prefill chunk and on every decode step.
    `compat` is the digest of the compatibility key the producer meant; the consumer re-checks it
    against the stream it arrived on and its engine.

    Continuation (docs/wire-format.md): a decode job with `n > 1` asks for up to n tokens. The worker
    feeds its token at start_position, then each token it samples at the next position, one per
    decode call, answering each under `result_job_id(job_id, offset)`, until n tokens, a stop token,
    max_tokens or a cancellation. A decode job with no token (`tokens == ()`) continues from the
    session's own last sampled token (a continuation pushed ahead, before the producer knows it):
    it starts where the previous job's tokens end (`end_position`), which the worker checks.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    job_id: str = Id
    session_id: str = Id
    hop: int = Field(default=0, ge=0, lt=16)
    phase: Phase
    compat: str = Field(pattern=r"^[0-9a-f]{16}$")
    start_position: int = Field(ge=0, le=MAX_POSITION)
    tokens: tuple[int, ...] = Field(max_length=MAX_TOKENS_PER_JOB)
    sample: bool = True
    attempt: int = Field(default=0, ge=0, le=1000)
    created_at: float = Field(ge=0.0, allow_inf_nan=False)
    session: SessionSpec | None = None
    # The input activations, one row per token: present exactly when the target hop consumes hidden
    # (the worker checks that against its boundary schema; tokens still name the session's tokens).
    hidden: Activations | None = None
    n: int = Field(default=1, ge=1, le=MAX_CONTINUATION)  # tokens asked for (decode only; 1: one step)

    @model_validator(mode="after")
    def _check(self) -> StepJob:
        if self.hidden is not None and self.hidden.rows != len(self.tokens):
            raise ValueError(f"hidden has {self.hidden.rows} rows for {len(self.tokens)} tokens")
        if any(t < 0 or t > MAX_TOKEN_ID for t in self.tokens):
            raise ValueError(f"tokens must be in [0, {MAX_TOKEN_ID}]")
        if self.phase == "prefill" and not self.tokens:
            raise ValueError("a prefill chunk carries tokens (at least one)")
        if self.phase == "decode" and len(self.tokens) > 1:
            raise ValueError("a decode step carries exactly one token (or none: the session's own last one)")
        if self.phase != "decode" and self.n != 1:
            raise ValueError("only a decode job asks for n > 1 tokens")
        if self.n > 1 and len(self.job_id) > MAX_CONTINUATION_JOB_ID:
            raise ValueError(f"a job with n > 1 has a job id of at most {MAX_CONTINUATION_JOB_ID} characters")
        if self.phase == "decode" and not self.sample:
            raise ValueError("a decode step always samples")
        if self.session is not None and self.session.session_id != self.session_id:
            raise ValueError("session.session_id differs from session_id")
        if (self.phase == "prefill" and self.start_position == 0) != (self.session is not None):
            raise ValueError("the SessionSpec travels exactly with the opening prefill (start_position 0)")
        return self

    @property
    def end_position(self) -> int:
        """Where the next job of the session starts: after the prefill chunk's tokens, or after the n
        positions a decode job feeds (its last sampled token goes there)."""
        if self.phase == "decode":
            return self.start_position + self.n
        return self.start_position + len(self.tokens)

    def answer_id(self, offset: int, ok: bool, duplicate: bool = False) -> str:
        """The result id of this job's answer: token number `offset` when ok; for a job with n > 1 an
        answer that ends it without a token takes `end_job_id` (a DUPLICATE keeps the job id: the
        record of its first answer stands). A job with n = 1 always answers under its own id."""
        if ok:
            return result_job_id(self.job_id, offset)
        return end_job_id(self.job_id) if self.n > 1 and not duplicate else self.job_id


class Status(StrEnum):
    OK = "ok"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    STATE_LOST = "state_lost"
    FAILED = "failed"


class Reason(StrEnum):
    """Why a step was not served as asked. Each admission check has its own code."""

    INCOMPATIBLE = "incompatible"  # compatibility key differs from the stream's or the engine's
    DUPLICATE = "duplicate"  # position below the session's next: already served
    POSITION_GAP = "position_gap"  # position above the session's next
    BAD_TOKEN = "bad_token"  # token id outside the vocabulary
    TOO_LONG = "too_long"  # over the context per session or the tokens per call
    CANCELLED = "cancelled"
    CAPACITY = "capacity"  # no free sequence slot for a new session
    UNKNOWN_SESSION = "unknown_session"  # a step for a session this worker does not hold
    ALREADY_OPEN = "already_open"  # an opening prefill for a session that is open
    FINISHED = "finished"  # a step after the session reached max_tokens or a stop token
    ENGINE_ERROR = "engine_error"
    MALFORMED = "malformed"  # not a valid StepJob (dead-lettered when no session can be told)
    SCHEMA_VERSION = "schema_version"
    TOO_MANY_DELIVERIES = "too_many_deliveries"
    WRONG_HOP = "wrong_hop"  # the hop is not on the session's route, or the hop's worker is not this worker
    ACCOUNT_LIMIT = "account_limit"  # the billing account holds its most slots on this worker
    BAD_SIGNATURE = "bad_signature"  # signing is on and the entry's HMAC is missing or wrong (dead letter only)
    BAD_ACTIVATIONS = "bad_activations"  # the step's activations are missing, malformed or not this hop's schema


class Accounting(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    prompt_tokens: int = Field(default=0, ge=0)
    generated_tokens: int = Field(default=0, ge=0)
    engine_seconds: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)

    @property
    def tokens_charged(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class StepResult(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    job_id: str = Id
    session_id: str = Id
    status: Status
    reason: Reason | None = None
    detail: str = Field(default="", max_length=MAX_REASON_LEN)
    position: int = Field(ge=0, le=MAX_POSITION + MAX_TOKENS_PER_JOB)  # the session's next position
    token: int | None = Field(default=None, ge=0, le=MAX_TOKEN_ID)
    finished: bool = False  # max_tokens or a stop token reached: the worker released the session
    accounting: Accounting = Accounting()
    worker_id: str = Id
    batch_size: int = Field(default=0, ge=0, le=1 << 16)  # sessions in the fused call that served it
    # A non-last hop's OK answer: its output activations, one row per token of the job (no token).
    hidden: Activations | None = None

    @model_validator(mode="after")
    def _check(self) -> StepResult:
        if (self.status == Status.OK) != (self.reason is None):
            raise ValueError("a reason is given exactly when status is not ok")
        if self.hidden is not None and (self.status != Status.OK or self.token is not None):
            raise ValueError("activations come only with an OK answer that sampled no token")
        return self
