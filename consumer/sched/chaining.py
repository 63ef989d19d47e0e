"""The decode call after the one in flight, built before that one is reported (issue 32, item 1; vLLM's
asynchronous scheduling, PRs #23569 and #32618): the engine thread runs it as soon as it has sampled the call
before, so the engine does not wait for the loop's report, answers and next batch between two calls.

`successor(batch)` is a query: it changes nothing. It is what `next_batch` would give once `batch` is reported,
when nothing can change that but the tokens `batch` samples: every row a plain greedy one (its token is the
row's argmax: the engine thread takes it), no other session ready in either phase, no slot waiting to be
cleared. Its rows are the sessions of `batch` that go on (their job's next offset, or the next continuation
job already queued, which starts where this one ends), in the order `next_batch` pops them (by the sequence
number their head will have); a session `batch` ends by max_tokens, or whose credit ends with no job queued,
has no row. Each row's input token is the one `batch` samples for its session (`Successor.source`), unless its
job carries its own.

The engine thread runs it only when none of those tokens is a stop token of its session and every row's
argmax is a token it may sample (else the loop reports `batch` and builds the next call as always), and the
loop withdraws it while it has not started if a cancellation or a newly ready session comes in (worker/calls.py).
Once it ran, `adopt(successor)` after `batch`'s report takes it as `next_batch` would have: each session whose
head is still the row's job and offset is taken out of the ready queue and handed out; a session closed since
(a cancellation) has nothing to take and its row's output is dropped; one still open whose head is not the
row's (not expected: the rules above exclude it) is answered state_lost, since its engine state holds a row the
scheduler never handed out. So the calls the engine ran are the calls `next_batch` gives, one call earlier,
and every bound of scheduler.py holds: a session that becomes ready while a chained call computes waits for it
as for any call in flight, and no further call is chained while it waits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter

import numpy as np
import numpy.typing as npt

from schemas import Reason, Sampling, Status
from schemas.limits import MAX_STOP_TOKENS

from ..batch import FusedBatch
from .outputs import Answer, BatchItem, ScheduledBatch
from .state import SchedulerState, SessionQueue, _Queued

__all__ = ["Adopted", "Chaining", "Successor"]


@dataclass(frozen=True)
class Successor:
    """A decode call built ahead: its rows (the session's queue, the job and the offset each takes, as `adopt` will
    hand them out) and the engine's batch of them. `source[i]`: the index, among the sampling rows of the call
    before, of row i's session: the token sampled there is row i's input, unless `own[i]` (its job carries its
    input token, already in the batch). `stops[i]`: row i's session's stop tokens (sampled in the call before, one
    ends the session there: no row may follow); `any_stop`: every stop token of the rows, sorted, once each (most
    sessions share theirs: the end-of-generation tokens)."""

    rows: tuple[tuple[SessionQueue, _Queued, int], ...]
    batch: ScheduledBatch
    source: npt.NDArray[np.intp]
    own: npt.NDArray[np.bool_]
    stops: tuple[tuple[int, ...], ...]
    any_stop: npt.NDArray[np.int64]

    def fill(self, sampled: npt.NDArray[np.integer]) -> bool:
        """Write the tokens the call before sampled (one per sampling row) into the rows' inputs; False (nothing
        written) when one of them ends its session. On the engine thread, between two calls: a few array
        operations whatever the rows (a row's own stop tokens are read only when its token is one of the rows')."""
        tokens = sampled[self.source]
        if self.any_stop.size:
            # a few stop tokens (the usual: the sessions share their end-of-generation ones) compared at once: 2
            # against np.isin's 11 µs for 8 rows and 3 stops (timeit), on the engine's path between two calls
            hit = (tokens[:, None] == self.any_stop).any(axis=1) if self.any_stop.size <= MAX_STOP_TOKENS \
                else np.isin(tokens, self.any_stop)
            for r in np.flatnonzero(hit).tolist():
                if int(tokens[r]) in self.stops[r]:
                    return False
        fed = self.batch.fused.tokens
        if self.own.any():
            fed[~self.own] = tokens[~self.own]
        else:  # the usual call: every input is a sampled token
            fed[:] = tokens
        return True


@dataclass(frozen=True)
class Adopted:
    """What `adopt` made of a successor the engine ran: the call as handed out (None: no session of it is still
    open), the successor's rows it keeps (their output rows, in order), and the answers of sessions lost."""

    batch: ScheduledBatch | None
    rows: list[int]
    answers: list[Answer]


class Chaining(SchedulerState):
    def successor(self, batch: ScheduledBatch, plain: Callable[[Sampling | None], bool]) -> Successor | None:
        """The decode call after `batch` (in flight), or None; see the module docstring. `plain`: whether a
        row's sampling is a plain greedy one (consumer/sampling/stage.py). A row's `source` is its item's index in
        `batch`, the engine's row when the engine runs `batch` as handed out (a chained call adopted without some
        of its rows is followed by none: those rows' sessions closed, so their slots wait to be cleared)."""
        if batch.phase != "decode" or self._queues["decode"].n_ready or self._queues["prefill"].n_ready \
                or self.table.n_dirty or self._finished_saves:
            return None
        rows: list[tuple[int, int, SessionQueue, _Queued, int]] = []  # (seq, source, lane, job, offset)
        inflight = self._inflight
        for k, it in enumerate(batch.items):
            lane = inflight.get(it.slot)
            if lane is None or not it.samples or it.n_tokens != 1 or len(lane.inflight) != 1:
                return None
            q = lane.inflight[0]
            if q.in_flight != (it.offset, 1):
                return None
            if lane.greedy is None:
                lane.greedy = plain(lane.entry.spec.sampling)
            if not lane.greedy:
                return None
            if lane.closed is not None:
                continue
            entry = lane.entry
            if entry.generated + 1 >= entry.spec.max_tokens:
                continue  # this call ends it
            head = lane.jobs[0] if lane.jobs else None
            if head is q and q.consumed == it.offset + 1:
                rows.append((q.seq, k, lane, q, it.offset + 1))
            elif head is not None and head is not q and head.job.phase == "decode" and head.consumed == 0 \
                    and head.job.start_position == it.end_position:
                rows.append((head.seq, k, lane, head, 0))
            elif head is not None:
                return None  # something else follows (a prefill job: a replay): next_batch decides
        if not rows:
            return None
        rows.sort(key=itemgetter(0))
        taken: list[tuple[SessionQueue, _Queued, int]] = []
        source, own, slots, positions, tokens, stops = [], [], [], [], [], []
        for _, k, lane, q, off in rows:  # one pass: a few hundred rows a call
            taken.append((lane, q, off))
            job = q.job
            carried = off == 0 and bool(job.tokens)  # the job carries its input token
            source.append(k)
            own.append(carried)
            tokens.append(job.tokens[0] if carried else 0)
            slots.append(lane.entry.slot)
            positions.append(job.start_position + off)
            stops.append(lane.entry.spec.stop_tokens)
        fused = FusedBatch(phase="decode", slots=np.array(slots, dtype=np.int32),
                           positions=np.array(positions, dtype=np.int32), tokens=np.array(tokens, dtype=np.int32),
                           wants_logits=np.ones(len(rows), np.bool_))
        any_stop = np.array(sorted({t for s in set(stops) for t in s}), dtype=np.int64)
        return Successor(tuple(taken), ScheduledBatch("decode", fused, ()), np.array(source, dtype=np.intp),
                         np.array(own, dtype=np.bool_), tuple(stops), any_stop)

    def adopt(self, successor: Successor) -> Adopted:
        """Hand out a successor the engine ran, once the call before it is reported; see the module docstring."""
        fed = successor.batch.fused.tokens.tolist()
        queue = self._queues["decode"]
        taken: list[SessionQueue] = []
        kept: list[int] = []
        lost: list[Answer] = []
        for k, (lane, q, offset) in enumerate(successor.rows):
            if lane.closed is not None or self._lanes.get(lane.session_id) is not lane:
                continue  # closed while its row computed (a cancellation): its output is dropped
            head = lane.jobs[0] if lane.jobs else None
            if head is not q or q.consumed != offset or lane.ready_phase != "decode" or fed[k] != (
                    q.job.tokens[0] if offset == 0 and q.job.tokens else lane.entry.last_token):
                lost += self._lose(lane)
                continue
            taken.append(lane)
            kept.append(k)
        # out of the ready queue in row order (their heap order): all at once when they are every ready session,
        # the chained steady state
        if not queue.take_all_out(taken):
            for lane in taken:
                queue.take_out(lane)
        take = self._take_decode_row  # type: ignore[attr-defined]  # Batching
        items: list[BatchItem] = [take(lane, row) for row, lane in enumerate(taken)]
        if not items:
            return Adopted(None, [], lost)
        # every row kept: the engine's batch is the one handed out (the inputs were checked above)
        fused = successor.batch.fused if len(kept) == len(successor.rows) else None
        return Adopted(self._handed_out("decode", items, fused), kept, lost)  # type: ignore[attr-defined]

    def _lose(self, lane: SessionQueue) -> list[Answer]:
        """Close an open session whose engine state holds a row it was not handed out: its queued jobs answered
        state_lost (the Tracker replays it from its tokens)."""
        out = [self._failed(lane, q, "the engine computed a row the scheduler did not hand out",  # type: ignore[attr-defined]
                            0, Status.STATE_LOST, Reason.ENGINE_ERROR) for q in self._drop_queued(lane)]
        self._close(lane, "failed")
        return out
