"""What a step's answer says: its status, and why when it is not `ok`. Each admission check has its own
reason code (docs/wire-format.md)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Reason", "Status"]


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
    JOB_ID_CONFLICT = "job_id_conflict"  # another job than the one held or answered under this job id
    FINISHED = "finished"  # a step after the session reached max_tokens or a stop token
    ENGINE_ERROR = "engine_error"
    MALFORMED = "malformed"  # not a valid StepJob (dead-lettered when no session can be told)
    SCHEMA_VERSION = "schema_version"  # another wire version than this side speaks (docs/wire-format.md)
    TOO_MANY_DELIVERIES = "too_many_deliveries"
    WRONG_HOP = "wrong_hop"  # the hop is not on the session's route, or the hop's worker is not this worker
    ACCOUNT_LIMIT = "account_limit"  # the billing account holds its most slots on this worker
    BAD_SIGNATURE = "bad_signature"  # signing is on and the entry's HMAC is missing or wrong (dead letter only)
    BAD_ACTIVATIONS = "bad_activations"  # the step's activations are missing, malformed or not this hop's schema
    GRAMMAR_INVALID = "grammar_invalid"  # the session's grammar or JSON schema does not compile (at its opening)
    GRAMMAR_UNSUPPORTED = "grammar_unsupported"  # a grammar asked of an engine without a llama.cpp vocabulary
    NO_TOKEN = "no_token"  # the session's masks left no token to sample (every id banned or -inf)
