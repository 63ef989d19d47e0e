"""Step jobs (Tracker -> worker) and step results (worker -> Tracker)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .activations import Activations
from .compat import Phase
from .limits import ID_PATTERN, MAX_POSITION, MAX_REASON_LEN, MAX_TOKEN_ID, MAX_TOKENS_PER_JOB, SCHEMA_VERSION
from .session import SessionSpec

Id = Field(pattern=ID_PATTERN)


class StepJob(BaseModel):
    """One step of one session on one hop: a prefill chunk, or one decode token.

    The first prefill chunk (start_position 0) carries the SessionSpec, which opens the session on the
    worker. `sample` asks for a token back: set on the last prefill chunk and on every decode step.
    `compat` is the digest of the compatibility key the producer meant; the consumer re-checks it
    against the stream it arrived on and its engine.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    job_id: str = Id
    session_id: str = Id
    hop: int = Field(default=0, ge=0, lt=16)
    phase: Phase
    compat: str = Field(pattern=r"^[0-9a-f]{16}$")
    start_position: int = Field(ge=0, le=MAX_POSITION)
    tokens: tuple[int, ...] = Field(min_length=1, max_length=MAX_TOKENS_PER_JOB)
    sample: bool = True
    attempt: int = Field(default=0, ge=0, le=1000)
    created_at: float = Field(ge=0.0, allow_inf_nan=False)
    session: SessionSpec | None = None
    # The input activations, one row per token: present exactly when the target hop consumes hidden
    # (the worker checks that against its boundary schema; tokens still name the session's tokens).
    hidden: Activations | None = None

    @model_validator(mode="after")
    def _check(self) -> StepJob:
        if self.hidden is not None and self.hidden.rows != len(self.tokens):
            raise ValueError(f"hidden has {self.hidden.rows} rows for {len(self.tokens)} tokens")
        if any(t < 0 or t > MAX_TOKEN_ID for t in self.tokens):
            raise ValueError(f"tokens must be in [0, {MAX_TOKEN_ID}]")
        if self.phase == "decode" and len(self.tokens) != 1:
            raise ValueError("a decode step carries exactly one token")
        if self.phase == "decode" and not self.sample:
            raise ValueError("a decode step always samples")
        if self.session is not None and self.session.session_id != self.session_id:
            raise ValueError("session.session_id differs from session_id")
        if (self.phase == "prefill" and self.start_position == 0) != (self.session is not None):
            raise ValueError("the SessionSpec travels exactly with the opening prefill (start_position 0)")
        return self

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.tokens)


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
