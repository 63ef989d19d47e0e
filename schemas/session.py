"""A session as the Tracker opens it: who pays, which route, how to sample, when to stop."""

from __future__ import annotations

import json
import math
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


# Limits of the per-row sampling controls (docs/sampling.md). A SessionSpec travels in one stream field
# (MAX_FIELD_BYTES, 64 KiB): a Sampling's JSON stays within MAX_SAMPLING_BYTES, room left for the route.
MAX_SAMPLING_BYTES = 40 * 1024
MAX_TOKEN_LIST = 2048  # allowed_token_ids, banned_token_ids, logit_bias entries
MAX_LOGPROBS = 20  # top-N log-probabilities per token (OpenAI's and vLLM's default ceiling)
MAX_GRAMMAR_CHARS = 32 * 1024  # a GBNF grammar or a JSON schema, as text
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's and vLLM's range)
MAX_REPETITION_PENALTY = 10.0
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (as vLLM): float32 scores stay finite


def _check_ids(name: str, ids: tuple[int, ...]) -> None:
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):  # in C: no generator resumed per id
        raise ValueError(f"{name} must be token ids in [0, {MAX_TOKEN_ID}]")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} must not repeat an id")


def _check_text(name: str, text: str) -> None:
    if not text.strip():
        raise ValueError(f"{name} must not be blank")
    if "\x00" in text:
        raise ValueError(f"{name} must not contain NUL")


class Sampling(BaseModel):
    """How a session's tokens are drawn: the exact arithmetic is docs/sampling.md.

    temperature 0 (any below GREEDY_BELOW) or top_k 1 means greedy. The random stream is derived from
    (seed, position) only. Every control is per row: none enters a compatibility key, none is billed.
    The defaults sample greedily with no penalty, no bias, no constraint and no log-probabilities."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=0, le=1 << 20)  # 0: no top-k cut
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # 0: no min-p cut
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    # Penalties over the last penalty_last_n tokens of the session's context (-1: the whole context, 0:
    # none), the prompt included unless penalize_prompt is false. 1.0 / 0.0: off.
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    penalty_last_n: int = Field(default=64, ge=-1, le=MAX_POSITION)
    penalize_prompt: bool = True
    # (token id, bias) pairs added to the logits; ids unique.
    logit_bias: tuple[tuple[int, float], ...] = Field(default=(), max_length=MAX_TOKEN_LIST)
    # End-of-generation tokens and the session's stop tokens are not sampled before this many tokens.
    min_tokens: int = Field(default=0, ge=0, le=MAX_GENERATE)
    allowed_token_ids: tuple[int, ...] | None = Field(default=None, min_length=1, max_length=MAX_TOKEN_LIST)
    banned_token_ids: tuple[int, ...] = Field(default=(), max_length=MAX_TOKEN_LIST)
    # Tokens the vocabulary marks control or unused (not end-of-generation) are never sampled unless true.
    allow_special: bool = False
    # None: no log-probabilities; N >= 0: the chosen token's and the N most likely tokens' (docs/sampling.md).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Constrained output through llama.cpp's grammar sampler: a GBNF grammar (rule `root`), or a JSON
    # schema (JSON text) converted to GBNF by llama-cpp-python's converter. At most one.
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    json_schema: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)

    @model_validator(mode="after")
    def _check(self) -> Sampling:
        _check_ids("banned_token_ids", self.banned_token_ids)
        if self.allowed_token_ids is not None:
            _check_ids("allowed_token_ids", self.allowed_token_ids)
            if set(self.allowed_token_ids) <= set(self.banned_token_ids):
                raise ValueError("every allowed token is banned: no token could be sampled")
        if self.logit_bias:
            _check_ids("logit_bias ids", tuple([t for t, _ in self.logit_bias]))
            if any(not math.isfinite(b) or abs(b) > MAX_BIAS for _, b in self.logit_bias):
                raise ValueError(f"logit_bias values must be finite, in [-{MAX_BIAS}, {MAX_BIAS}]")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("give a grammar or a json_schema, not both")
        if self.grammar is not None:
            _check_text("grammar", self.grammar)
        if self.json_schema is not None:
            _check_text("json_schema", self.json_schema)
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise ValueError(f"json_schema is not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (or true / false)")
        if (self.grammar or self.json_schema or self.logit_bias or self.banned_token_ids or self.allowed_token_ids) \
                and len(self.model_dump_json()) > MAX_SAMPLING_BYTES:
            raise ValueError(f"sampling is over {MAX_SAMPLING_BYTES} bytes as JSON (a stream field holds the whole "
                             "session spec): shorten the grammar or the token lists")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (they need the session's context)."""
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def constrained(self) -> bool:
        return self.grammar is not None or self.json_schema is not None


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
    # prefill; a worker whose recipe is batch-invariant computes the positions from prompt_len on one row per
    # call, as they were computed when they were decoded, so the replay gives the same bits
    # (docs/invariance.md); another computes them as more prompt. None: every prefilled token is prompt.
    prompt_len: int | None = Field(default=None, ge=1, le=MAX_POSITION)
    # Prefix cache isolation (vLLM's name): set, the session shares cached prompt blocks only with sessions
    # of the same salt, whatever the worker's --prefix-cache-scope (docs/security.md, schemas/prefix.py).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _check(self) -> SessionSpec:
        stops = self.stop_tokens  # ints (strict): their least and greatest, in C (no generator per session)
        if stops and (min(stops) < 0 or max(stops) > MAX_TOKEN_ID):
            raise ValueError(f"stop_tokens must be in [0, {MAX_TOKEN_ID}]")
        return self
