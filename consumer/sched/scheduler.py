"""The scheduling core: which queued steps go into the next fused engine call. Pure and synchronous.

No I/O, no Redis, no engine, no sampler, no clock: the worker feeds it jobs (`admit`, `cancel`), asks
it for a call (`next_batch`), runs the engine and the sampler (consumer/sampler.py), and reports back
the sampled tokens (`update_from_output`) or the failure (`fail`). Everything it
decides comes back as plain frozen dataclasses, so it is unit-testable in microseconds (modelled on
vLLM v1's scheduler). Nothing in here scans the session table: every operation costs O(jobs
touched · log queued), whatever the number of idle sessions.

Phases and fairness
-------------------
A call is either all decode or all prefill (a FusedBatch has one phase). The phases that have work
ready are served by smooth weighted round-robin (nginx): every round each ready phase adds its
weight to its current weight, the largest current weight wins (decode on a tie) and loses the sum
of the ready phases' weights. A phase with nothing ready keeps its current weight untouched.

Bounds, with weights w_decode = a and w_prefill = b, while both phases stay backlogged:

* decode waits at most ceil(b / a) consecutive prefill calls, each of at most `prefill_budget`
  tokens (so a decoding session's step waits at most ceil(b / a) · prefill_budget prefill tokens,
  plus the decode calls ahead of it in its own queue);
* prefill waits at most ceil(a / b) consecutive decode calls, so it is served at least once in
  every a + b consecutive calls (exactly b times in each period of a + b calls of the pattern);
* both bounds are tight: a saturated run reaches them (defaults 4:1 give D D P D D, repeated);
* no session waits forever: decode is FIFO by admission (oldest queued first, `max_batch` sessions
  per call), prefill alternates FIFO by admission and fewest rows left first, with chunking (so the
  oldest prompt is served at least every other prefill call), and each phase is served within the
  bounds above. A stretch during which only one phase has work leaves both current weights
  untouched, so the bounds hold across such stretches too.

tests/test_scheduler_properties.py checks these bounds on the scheduler itself over random arrival
patterns.

Decode calls: up to `max_batch` sessions, oldest queued step first, one row each, every row wants
logits. A continuation job (StepJob.n > 1) stays at the head of its lane and gives one row per call,
its next offset re-queued behind the steps admitted meanwhile (so FIFO holds as if each token were a
step of its own); the row's input is the session's last sampled token (SessionEntry.last_token) unless
the job's first offset carries one. Each offset is answered under its own result id; the job's last
answer (its n-th token, a stop, max_tokens) is `final` (it acks the entry).

Prefill calls (chunked prefill, as in Sarathi-Serve): jobs in admission order in one call and the
sessions with the fewest prompt rows left first in the next (batching.py), taking up to
`prefill_budget` tokens per call; a job longer than what is left of the budget is split across
calls (BatchItem.offset / n_tokens). Only the item that finishes a job with `job.sample` wants
logits, on its last row. A session's next prefill job may follow it in the same call (its
positions continue), unless the job before it samples.

In flight
---------
A session with an item in a call that was handed out and not yet completed / failed is *busy*: it
is not scheduled again until every item of that call for it is reported, so a failed call never
leaves a later call built on state that was rolled back. Every item of a ScheduledBatch must be
passed to exactly one `update_from_output` or `fail` (a batch may be split with `without` first, to retry or
bisect after an engine error). A session cancelled while busy keeps its slot until its items are
reported (then the slot is released), so `engine.release` never races an engine call on it.

Answers and closures
--------------------
Every admitted job gets exactly one `Answer`: decided without the engine (admission,
cancellation) or after a call. `close` ("finished" or "cancelled") is set on the one
answer that closed the session. A session closed with no answer to carry it (a cancel with nothing
queued) or closed because an engine call failed on it (answers FAILED, close None: the transport's
close marker knows only finished / cancelled) shows only in `drain_closed()`, which lists every
closure with its kind ("finished", "cancelled", "failed") and tallies.
"""


from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from schemas import Phase

from ..prefix.planner import Refill, Save
from .admission import JobAdmission
from .batching import Batching
from .chaining import Adopted, Chaining, Successor
from .config import SchedulerConfig
from .output_processor import OutputProcessor
from .outputs import Answer, AnswerClose, BatchItem, Outcome, ScheduledBatch, SchedulerStats
from .prefill_shape import MIN_BUDGET
from .prefix_plan import PrefixPlanning
from .session_table import ClosedSession, CloseKind

__all__ = [
    "Adopted", "Answer", "AnswerClose", "BatchItem", "CloseKind", "Outcome", "ScheduledBatch", "Scheduler",
    "SchedulerConfig", "SchedulerStats", "Successor",
]


class Scheduler(JobAdmission, Batching, OutputProcessor, PrefixPlanning, Chaining):
    """The whole scheduling core: admission, batching and the output processor over one state; the
    queries the worker asks between calls are here."""

    # ---- worker-facing queries ------------------------------------------------------------------

    def set_prefill_budget(self, tokens: int) -> None:
        """Token budget of the next prefill calls (the worker sizes them by time: consumer/pacing.py).
        Clamped like the configured one; the fairness bounds hold for any budget."""
        if tokens != self.config.prefill_budget:
            self.config = replace(self.config, prefill_budget=max(MIN_BUDGET, tokens))

    def want(self) -> dict[Phase, int]:
        """How many new stream entries to read per phase.

        decode: the decoding sessions that have no step queued, those amid a continuation job
        (their next job is pushed ahead), and, while none of those, one per prefill entry asked for (a
        wave of openings: each one's first continuation travels with it, consumer/worker/early.py), up to
        two calls' worth of queued decode steps (at least 1 while under that cap, so steps for sessions
        this worker does not hold are still read and answered state_lost).
        prefill: 0 while two calls' worth of prefill tokens are queued, else enough entries to
        bring the queued prefill jobs up to max_batch (at least 1).
        """
        cfg = self.config
        if self._queues["prefill"].tokens >= 2 * cfg.prefill_budget:
            prefill = 0
        else:
            prefill = max(1, cfg.max_batch - self._queues["prefill"].jobs)
        room = 2 * cfg.max_batch - self._queues["decode"].jobs
        # With nobody decoding yet (a wave of openings), read their first continuations with them.
        first = prefill if not (self._awaiting or self._continuing or self._queues["decode"].jobs) else 0
        decode = max(1, min(len(self._awaiting) + len(self._continuing) + first, room)) if room > 0 else 0
        return {"decode": decode, "prefill": prefill}

    def session_busy(self, session_id: str) -> bool:
        """Whether the open session has a step queued or in a call (so it is not idle)."""
        lane = self._lanes.get(session_id)
        return lane is not None and bool(lane.jobs or lane.inflight)

    def attempt(self, session_id: str) -> int | None:
        """The attempt of the opening that opened the session here (open or recently closed; None: unknown)."""
        return self._attempts.get(session_id)

    def is_awaiting(self, session_id: str) -> bool:
        """Whether the session is decoding with no step queued nor in flight (it holds no credit)."""
        return session_id in self._awaiting

    def awaiting_decode(self) -> int:
        """Decoding sessions with no step queued nor in flight."""
        return len(self._awaiting)

    def has_work(self) -> bool:
        """Whether next_batch() would return a call now."""
        return self._queues["decode"].n_ready > 0 or self._queues["prefill"].n_ready > 0

    def ready(self, phase: Phase) -> int:
        """Sessions whose next step, in this phase, could go into a call now."""
        return self._queues[phase].n_ready

    def queued(self, phase: Phase | None = None) -> int:
        """Jobs admitted and not yet fully handed to the engine."""
        if phase is None:
            return self._queues["decode"].jobs + self._queues["prefill"].jobs
        return self._queues[phase].jobs

    def in_flight(self) -> int:
        """Sessions with items in a call not yet reported."""
        return len(self._inflight)

    def drain_released(self) -> list[int]:
        """Slots released since the last call: call engine.release on each, then slot_cleared."""
        return self.table.drain_released()

    def saves_finished(self, slot: int) -> bool:
        """Whether finished_saves has something to keep of the session that closed on `slot`."""
        return slot in self._finished_saves

    def finished_saves(self, slots: Sequence[int], refill_rows: int = 0) -> list[tuple[int, Save | Refill | None]]:
        """What the prefix cache keeps of the finished sessions on slots drain_released returned, each to run
        before engine.release (their answers: PrefixPlanning._prefix_closed): a Save, a Refill, or None. A Refill
        recomputes work no one asked for yet, so at most one, of at most `refill_rows` positions, and only while
        nothing waits for the engine (no session decoding, no prompt ready): under load, or for a wave of
        sessions ending together, it would cost every answer never continued, where a next turn computes the
        answer only when it comes."""
        out: list[tuple[int, Save | Refill | None]] = []
        refills = 1
        for slot in slots:
            idle = refills > 0 and not (self.awaiting_decode() or self.ready("decode") or self.ready("prefill"))
            kept = self._prefix_finished(slot, refill_rows if idle else 0)
            refills -= isinstance(kept, Refill)
            out.append((slot, kept))
        return out

    def slot_cleared(self, slot: int) -> None:
        self._finished_saves.pop(slot, None)  # never run on the slot's next session
        self.table.slot_cleared(slot)

    def drain_closed(self) -> list[ClosedSession]:
        """Every session closed since the last call (finished, cancelled, failed), with its tallies."""
        out = list(self._closed_log)
        self._closed_log.clear()
        return out
