"""The scheduler's settings: what a fused call may hold and how the phases share calls."""

from __future__ import annotations

from dataclasses import dataclass

from ..batch import EngineCapacity
from ..config import WorkerSettings
from .prefill_shape import MIN_BUDGET
from .session_table import SessionTable

__all__ = ["SchedulerConfig"]


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_batch` is clamped to n_slots and max_tokens_per_call, `prefill_budget` to
    max_tokens_per_call, so a config with defaults fits any engine. `prefill_budget` is at least
    MIN_BUDGET (3): a prompt is never computed one row at a time (consumer/sched/prefill_shape.py)."""

    capacity: EngineCapacity  # n_slots, ctx_per_session, max_tokens_per_call, vocab_size
    # The defaults are the worker's (consumer/config.py), written once.
    max_batch: int = WorkerSettings.max_batch  # decode sessions per fused call
    prefill_budget: int = WorkerSettings.prefill_budget  # tokens per prefill call
    w_decode: int = WorkerSettings.w_decode
    w_prefill: int = WorkerSettings.w_prefill
    closed_capacity: int = SessionTable.DEFAULT_CLOSED_CAPACITY  # closed sessions remembered
    # Most sessions one billing account may hold open on this worker at once (0: no limit), so one
    # account cannot take every slot (docs/security.md, "Fair use of slots").
    max_slots_per_account: int = WorkerSettings.max_slots_per_account
    # A replay's generated tokens (positions from the spec's prompt_len on) computed one row per prefill call, as
    # when they were decoded: what keeps a replay exact under a batch-invariant recipe (docs/invariance.md, cause
    # 4), at one prefill turn per token. An engine whose recipe is not batch-invariant promises no exact replay,
    # so the worker turns it off there (consumer/worker/lane.py) and a replay is computed as one prompt. (A Tracker
    # replays a one-hop session on such a recipe by sampling its tokens again instead, producer/steps.py
    # `regenerates`; this rule is for the replays that re-feed them: routes of several hops, a replay that diverged.)
    exact_replay: bool = True

    def __post_init__(self) -> None:
        cap = self.capacity
        if min(cap.n_slots, cap.ctx_per_session, cap.max_tokens_per_call, cap.vocab_size) < 1:
            raise ValueError(f"capacity fields must all be >= 1: {cap}")
        if self.max_batch < 1 or self.prefill_budget < 1:
            raise ValueError("max_batch and prefill_budget must be >= 1")
        if self.w_decode < 1 or self.w_prefill < 1:
            raise ValueError("w_decode and w_prefill must be >= 1")
        if self.closed_capacity < 0:
            raise ValueError("closed_capacity must be >= 0")
        if self.max_slots_per_account < 0:
            raise ValueError("max_slots_per_account must be >= 0")
        object.__setattr__(self, "max_batch", min(self.max_batch, cap.n_slots, cap.max_tokens_per_call))
        object.__setattr__(self, "prefill_budget",
                           min(max(self.prefill_budget, MIN_BUDGET), cap.max_tokens_per_call))
