"""`ProducerSettings`: every setting of the Tracker side, one frozen object both drivers take."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from schemas import Signer
from schemas.limits import (
    ACTIVATION_TTL_S,
    CANCEL_MARKER_TTL_S,
    MAX_CONTINUATION,
    MAX_TOKENS_PER_JOB,
    OUTAGE_MAX_S,
    SESSION_RECORD_TTL_S,
    is_id,
)

from .placement_inputs import PlacementPolicy

__all__ = ["DECODE_N", "READ_COUNT", "ProducerSettings"]

READ_COUNT = 1_000  # result records per stream per XREAD, and per XRANGE page of resume
# Tokens per decode job by default (a continuation job: producer/steps.py `queue_next`), so a session never waits on the
# Tracker between tokens. 1: one job per token. n > 1 only from a worker advertising max_continuation, and
# never on a route of several hops.
DECODE_N = 16


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    """`tracker_id` names this Tracker's result stream on every worker (`dgr:{W}:out:<tracker_id>`: every job it
    pushes says `reply_to` it), a fresh one per Producer by default. `rewind_ms`: after a Redis outage the result
    streams are read again from this long before the last entry read (a new master after a failover may write
    ids below it; re-reading is safe, answers are applied once). `read_block_ms` / `poll_s`: the longest a
    blocking read waits (0: poll every poll_s, for servers whose blocking reads do not work)."""

    prefill_chunk: int = 512
    max_lag: int | None = 10_000
    backpressure: Literal["raise", "wait"] = "raise"
    timeout_s: float = 60.0
    max_attempts: int = 3
    verify_route: bool = True
    lag_cache_s: float = 0.1
    discover_cache_s: float = 1.0
    signer: Signer | None = None
    outage_max_s: float = OUTAGE_MAX_S
    cancel_ttl_s: int = CANCEL_MARKER_TTL_S
    record_ttl_s: int = SESSION_RECORD_TTL_S
    blob_ttl_s: int = ACTIVATION_TTL_S
    decode_n: int = DECODE_N
    read_block_ms: int = 1000
    poll_s: float = 0.002
    rewind_ms: int = 10_000
    tracker_id: str = field(default_factory=lambda: f"t-{secrets.token_hex(6)}")
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)  # SessionTemplates: docs/placement.md
    # A replay of a one-hop session on a batch-invariant recipe samples its tokens again in decode calls (checked
    # one by one; producer/steps.py `regenerates`). False: it re-feeds them as prompt (one row a prefill call).
    regenerate: bool = True

    @classmethod
    def of(cls, settings: ProducerSettings | None, options: dict[str, Any]) -> ProducerSettings:
        """`settings` (default: the defaults) with the keyword options given instead of its fields."""
        base = settings if settings is not None else cls()
        return replace(base, **options) if options else base

    def __post_init__(self) -> None:
        if not 1 <= self.prefill_chunk <= MAX_TOKENS_PER_JOB:
            raise ValueError(f"prefill_chunk must be in [1, {MAX_TOKENS_PER_JOB}]")
        if self.backpressure not in ("raise", "wait"):
            raise ValueError("backpressure must be 'raise' or 'wait'")
        if isinstance(self.decode_n, bool) or not isinstance(self.decode_n, int) \
                or not 1 <= self.decode_n <= MAX_CONTINUATION:
            raise ValueError(f"decode_n must be an int in [1, {MAX_CONTINUATION}]")
        if not is_id(self.tracker_id):
            raise ValueError("tracker_id must be an id (docs/wire-format.md)")
