"""What the scheduler hands out: its configuration and plain, typed outputs (as vLLM v1's
scheduler_output). The decisions that produce them live in consumer/scheduler.py."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np

from schemas import Phase, StepJob, StepResult

from .batch import FusedBatch
from .engines.base import EngineCapacity
from .prefill_shape import MIN_BUDGET
from .session_table import SessionTable


@dataclass(frozen=True)
class SchedulerConfig:
    """`max_batch` is clamped to n_slots and max_tokens_per_call, `prefill_budget` to
    max_tokens_per_call, so a config with defaults fits any engine. `prefill_budget` is at least
    MIN_BUDGET (3): a prompt is never computed one row at a time (consumer/prefill_shape.py)."""

    capacity: EngineCapacity  # n_slots, ctx_per_session, max_tokens_per_call, vocab_size
    max_batch: int = 16  # decode sessions per fused call
    prefill_budget: int = 512  # tokens per prefill call
    w_decode: int = 4
    w_prefill: int = 1
    closed_capacity: int = SessionTable.DEFAULT_CLOSED_CAPACITY  # closed sessions remembered
    # Most sessions one billing account may hold open on this worker at once (0: no limit), so one
    # account cannot take every slot (docs/security.md, "Fair use of slots").
    max_slots_per_account: int = 0

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


AnswerClose = Literal["finished", "cancelled"]  # what an answer's `close` can say (transport contract)


@dataclass(frozen=True, slots=True)
class Reply:
    """An answer decided without running the engine (rejection, cancellation, state_lost, duplicate)."""

    ref: object  # the handle given to admit() (the worker's stream Delivery), returned untouched
    job: StepJob | None
    result: StepResult
    account_id: str | None
    close: AnswerClose | None


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer for one job after a fused call; same shape as Reply."""

    ref: object
    job: StepJob
    result: StepResult
    account_id: str
    close: AnswerClose | None


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One job's share of a fused call: rows row_start .. row_start + n_tokens - 1, carrying
    job.tokens[offset : offset + n_tokens] at positions job.start_position + offset + i."""

    ref: object
    job: StepJob
    slot: int
    offset: int
    n_tokens: int
    row_start: int
    samples: bool  # its last row wants logits and a token comes back (job.sample, and it ends the job)

    @property
    def session_id(self) -> str:
        return self.job.session_id

    @property
    def first_position(self) -> int:
        return self.job.start_position + self.offset

    @property
    def completes_job(self) -> bool:
        return self.offset + self.n_tokens == len(self.job.tokens)


def _fuse(phase: Phase, items: Iterable[BatchItem]) -> tuple[FusedBatch, tuple[BatchItem, ...]]:
    """Rows of the items in order; items rebuilt with their row_start in the new call."""
    slots: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    wants: list[bool] = []
    out: list[BatchItem] = []
    for it in items:
        row = len(tokens)
        if it.row_start != row:
            it = replace(it, row_start=row)
        out.append(it)
        n = it.n_tokens
        first = it.job.start_position + it.offset
        if n == 1:
            slots.append(it.slot)
            positions.append(first)
            tokens.append(it.job.tokens[it.offset])
            wants.append(it.samples)
        else:
            slots.extend([it.slot] * n)
            positions.extend(range(first, first + n))
            tokens.extend(it.job.tokens[it.offset:it.offset + n])
            wants.extend([False] * (n - 1))
            wants.append(it.samples)
    fused = FusedBatch(
        phase=phase,
        slots=np.array(slots, dtype=np.int32),
        positions=np.array(positions, dtype=np.int32),
        tokens=np.array(tokens, dtype=np.int32),
        wants_logits=np.array(wants, dtype=np.bool_),
    )
    return fused, tuple(out)


@dataclass(frozen=True)
class ScheduledBatch:
    """One fused call: the engine's FusedBatch and which job each run of rows belongs to."""

    phase: Phase
    fused: FusedBatch
    items: tuple[BatchItem, ...]

    @classmethod
    def build(cls, phase: Phase, items: Iterable[BatchItem]) -> ScheduledBatch:
        fused, built = _fuse(phase, items)
        return cls(phase=phase, fused=fused, items=built)

    @property
    def session_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(it.job.session_id for it in self.items))

    def sessions_in_slots(self, slots: Collection[int]) -> tuple[str, ...]:
        """The sessions of this call held in the given slots (e.g. EngineError.slots)."""
        wanted = set(slots)
        return tuple(dict.fromkeys(it.job.session_id for it in self.items if it.slot in wanted))

    def without(self, session_ids: Collection[str]) -> ScheduledBatch | None:
        """The same call minus every item of the given sessions (rows rebuilt); None if empty."""
        drop = set(session_ids)
        keep = [it for it in self.items if it.job.session_id not in drop]
        if not keep:
            return None
        if len(keep) == len(self.items):
            return self
        return ScheduledBatch.build(self.phase, keep)

    def __len__(self) -> int:
        return len(self.fused)


@dataclass(slots=True)
class SchedulerStats:
    calls_decode: int = 0
    calls_prefill: int = 0
    rows_decode: int = 0
    rows_prefill: int = 0
    admitted: int = 0  # jobs queued
    rejected: int = 0  # jobs answered at admission (any non-queued answer)
    jobs_ok: int = 0
    jobs_cancelled: int = 0
    jobs_failed: int = 0
    tokens_sampled: int = 0
    sessions_opened: int = 0
    sessions_finished: int = 0
    sessions_cancelled: int = 0
    sessions_failed: int = 0
    stale_items: int = 0  # items reported to complete/fail that were not in flight (ignored)
    closed_dropped: int = 0  # closures dropped from drain_closed() because nobody drained them

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}
