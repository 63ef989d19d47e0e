"""A session as the Tracker opens it: who pays, which route, how to sample, when to stop."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .compat import CompatibilityKey
from .limits import (
    ID_PATTERN,
    MAX_GENERATE,
    MAX_POSITION,
    MAX_ROUTE_HOPS,
    MAX_STOP_TOKENS,
    MAX_TOKEN_ID,
    SCHEMA_VERSION,
)

Id = Field(pattern=ID_PATTERN)


class Sampling(BaseModel):
    """temperature 0 means greedy. The random stream is derived from (seed, position) only."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=1 << 20)  # 0: no top-k cut
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class RouteHop(BaseModel):
    """One worker on the session's route. The key's phase is not significant here: each step is
    sent on `key.for_phase(step.phase)`."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    worker_id: str = Id
    key: CompatibilityKey


class SessionSpec(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    session_id: str = Id
    account_id: str = Id
    route: tuple[RouteHop, ...] = Field(min_length=1, max_length=MAX_ROUTE_HOPS)
    sampling: Sampling = Sampling()
    max_tokens: int = Field(default=128, ge=1, le=MAX_GENERATE)
    stop_tokens: tuple[int, ...] = Field(default=(), max_length=MAX_STOP_TOKENS)
    # The session's own prompt length. A replay after state_lost re-sends prompt + generated tokens as
    # prefill; the worker computes the positions from prompt_len on one row per call, as they were
    # computed when they were decoded, so the replay gives the same bits (docs/invariance.md).
    # None: every prefilled token is prompt.
    prompt_len: int | None = Field(default=None, ge=1, le=MAX_POSITION)

    @model_validator(mode="after")
    def _check(self) -> SessionSpec:
        if any(t < 0 or t > MAX_TOKEN_ID for t in self.stop_tokens):
            raise ValueError(f"stop_tokens must be in [0, {MAX_TOKEN_ID}]")
        return self
