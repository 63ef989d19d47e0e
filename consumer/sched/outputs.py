"""What the scheduler hands out: plain, typed outputs (as vLLM v1's scheduler_output). The decisions
that produce them live in consumer/sched/scheduler.py and output_processor.py.

Names: what the scheduler decided for one step (or one token of a continuation) is an `Outcome`; with
what the transport needs to file it (the delivery handle, the job, the billing account, the closure)
it is an `Answer`. Every answer, whether decided at admission, by a cancellation or after a fused
call, is an `Answer`. The scheduler builds no wire model: the transport turns a call's answers into
one columnar result record (schemas/wire.py), and a Tracker reads the answers as `StepResult`s."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, Literal, NamedTuple

import msgspec
import numpy as np
from msgspec.structs import replace as struct_replace

from schemas import Activations, Phase, Reason, Sampling, Status, StepJob, TokenLogprobs

from ..batch import FusedBatch

# _PER_TOKEN: Outcome, Answer and BatchItem are built for every token of every fused call. As msgspec Structs
# they are made in C (a slotted dataclass's __init__ is a Python call storing each field: an Outcome and its
# Answer 0.69-0.75 us against 0.34-0.37, timeit) and untracked by the garbage collector (gc=False: they hold no
# container that could hold them back, so no cycle runs through them), as placement's Candidate and Choice are.
# They are never mutated after they are built (msgspec.structs.replace makes a changed copy).
AnswerClose = Literal["finished", "cancelled"]  # what an answer's `close` can say (transport contract)


class Tallies(NamedTuple):
    """What an outcome carries to be charged (the completion script decides what is: docs/accounting.md)."""

    prompt_tokens: int
    generated_tokens: int
    engine_seconds: float
    cached_tokens: int = 0  # prompt positions restored from the prefix cache (fed, charged apart)


class Outcome(msgspec.Struct, gc=False):  # treated as immutable; not frozen: built per token (see _PER_TOKEN)
    """What the scheduler decided for one step, or one token of a continuation job: what a Tracker will
    read as a StepResult (same names), before the completion script's charging rules."""

    job_id: str  # the result id (StepJob.answer_id)
    session_id: str
    status: Status
    reason: Reason | None
    position: int  # the session's next position after this answer
    detail: str = ""
    token: int | None = None
    finished: bool = False
    prompt_tokens: int = 0  # positions the job computed in prefill calls (docs/accounting.md charges them)
    engine_seconds: float = 0.0
    batch_size: int = 0
    hidden: Activations | None = None  # a non-last hop's OK answer: its output rows (no token)
    logprobs: TokenLogprobs | None = None  # the sampled token's, when the session asked (Sampling.logprobs)
    cached_tokens: int = 0  # prompt positions restored from the prefix cache, not computed (charged apart)
    # The record's optional columns (schemas/wire.py OPTIONAL_COLUMNS): same names, filed as they are.
    prefill_calls: int = 0  # the fused calls the job's prompt positions were computed in

    @property
    def generated_tokens(self) -> int:
        return 0 if self.token is None else 1

    @property
    def accounting(self) -> Tallies:
        """What the answer carries to be charged (the counters decide: docs/accounting.md)."""
        return Tallies(self.prompt_tokens, self.generated_tokens, self.engine_seconds, self.cached_tokens)


class Answer(msgspec.Struct, gc=False):  # treated as immutable; not frozen: built per token (see _PER_TOKEN)
    """One step's answer: decided at admission or by a cancellation (rejection, cancelled, state_lost,
    duplicate), or after a fused call (ok, failed)."""

    ref: object  # the handle given to admit() (the transport's delivery), returned untouched
    job: StepJob | None  # None: the entry could not be decoded into a job (a wire rejection)
    result: Outcome
    account_id: str | None  # None: a session this worker never held (nothing is charged)
    close: AnswerClose | None
    blob: bytes | None = None  # a non-last hop's output rows, written at result.hidden.blob by the completion
    # The job's last answer: its delivery is acked with it. False only for a continuation job's token
    # that is not its last (the job goes on: its entry stays pending, so a crash before its end leaves it
    # to be redelivered and answered state_lost).
    final: bool = True
    reply: str = ""  # the result stream it goes to (StepJob.reply; a wire rejection: its readable reply_to)


class BatchItem(msgspec.Struct, gc=False):  # treated as immutable; not frozen: built per token (see _PER_TOKEN)
    """One job's share of a fused call: rows row_start .. row_start + n_tokens - 1, carrying
    job.tokens[offset : offset + n_tokens] at positions job.start_position + offset + i."""

    ref: object
    job: StepJob
    slot: int
    offset: int
    n_tokens: int
    row_start: int
    samples: bool  # its last row wants logits and a token comes back (job.sample, and it ends the job)
    sampling: Sampling | None = None  # the session's sampling parameters, when `samples`
    # A decode row's input token when it is not job.tokens[offset]: a continuation's later offsets,
    # or a job with no token, feed the session's own last sampled token.
    token: int | None = None

    @property
    def session_id(self) -> str:
        return self.job.session_id

    @property
    def first_position(self) -> int:
        return self.job.start_position + self.offset

    @property
    def end_position(self) -> int:
        """The position after the item's last row: where its sampled token (if any) goes."""
        return self.job.start_position + self.offset + self.n_tokens

    @property
    def completes_job(self) -> bool:
        """The item ends its prefill job's tokens; for a decode job, it answers its offset (each
        decode item gets an answer, a continuation's last one or not)."""
        if self.job.phase == "decode":
            return True
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
            it = struct_replace(it, row_start=row)
        out.append(it)
        n = it.n_tokens
        first = it.job.start_position + it.offset
        if n == 0:  # a job restored whole from the prefix cache: answered by this call, no row of its own
            continue
        if n == 1:
            slots.append(it.slot)
            positions.append(first)
            tokens.append(it.token if it.token is not None else it.job.tokens[it.offset])
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
    # The prefix cache (consumer/prefix/planner.py): Restore directives run before the call, Save after it.
    restores: tuple[Any, ...] = ()
    saves: tuple[Any, ...] = ()

    @classmethod
    def build(cls, phase: Phase, items: Iterable[BatchItem]) -> ScheduledBatch:
        fused, built = _fuse(phase, items)
        return cls(phase=phase, fused=fused, items=built)

    @cached_property  # read several times per call (its batch size): one pass over the items, not one each
    def session_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([it.job.session_id for it in self.items]))

    @cached_property  # read by the sampler, the report and the worker's answers: one pass per call
    def sampling_items(self) -> tuple[BatchItem, ...]:
        """The items that sample (a token comes back for each, in item order: one logits row each)."""
        return tuple([it for it in self.items if it.samples])  # a list first: no generator resumed per item

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
        slots = {it.slot for it in keep}
        return replace(ScheduledBatch.build(self.phase, keep),
                       restores=tuple(r for r in self.restores if r.slot in slots),
                       saves=tuple(s for s in self.saves if s.slot in slots))

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
    rejected_capacity: int = 0  # of those, openings refused for want of a free slot (Reason.CAPACITY)
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
