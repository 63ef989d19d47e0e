"""Which queued steps go into the next fused call: the phase by smooth weighted round-robin, then up to
max_batch decode rows, oldest first, or prefill pieces up to the token budget (consumer/sched/scheduler.py
states the bounds)."""

from __future__ import annotations

from operator import itemgetter

from schemas import Phase

from ..batch import FusedBatch
from .outputs import BatchItem, ScheduledBatch
from .prefill_shape import MIN_BUDGET, piece_rows
from .state import SchedulerState, SessionQueue

__all__ = ["Batching"]


# The phases' party numbers in the round-robin: decode first, so it wins a tie.
TURN_ORDER: tuple[Phase, Phase] = ("decode", "prefill")


class Batching(SchedulerState):
    def _pick_phase(self) -> Phase | None:
        ready = [i for i, phase in enumerate(TURN_ORDER) if self._queues[phase].n_ready > 0]
        i = self._phase_turns.pick(ready)
        return None if i is None else TURN_ORDER[i]

    def next_batch(self) -> ScheduledBatch | None:
        """The next fused call, or None when nothing is ready. See the module docstring."""
        while True:
            before = self._phase_turns.state()
            phase = self._pick_phase()
            if phase is None:
                return None
            items = self._take_decode() if phase == "decode" else self._take_prefill()
            if items:
                break
            # Every ready prefill session waits for more of its prompt (and left the ready heap): the
            # round did not happen, so the weights are as they were; pick again.
            self._phase_turns.restore(before)
        return self._handed_out(phase, items)

    def _handed_out(self, phase: Phase, items: list[BatchItem], fused: FusedBatch | None = None) -> ScheduledBatch:
        """The call of these items (taken out of their queues), with what the prefix cache plans for it. `fused`:
        its rows when already built (a chained call's: Chaining.adopt)."""
        batch = ScheduledBatch.build(phase, items) if fused is None else ScheduledBatch(phase, fused, tuple(items))
        if phase == "prefill":
            batch = self._prefix_directives(batch)  # type: ignore[attr-defined]  # PrefixPlanning
        else:
            self._prefix_decoded(batch)  # type: ignore[attr-defined]  # PrefixPlanning
        if phase == "decode":
            self.stats.calls_decode += 1
            self.stats.rows_decode += len(batch.fused)
        else:
            self.stats.calls_prefill += 1
            self.stats.rows_prefill += len(batch.fused)
        return batch

    def _take_decode(self) -> list[BatchItem]:
        items: list[BatchItem] = []
        pop = self._queues["decode"].pop
        for row in range(self.config.max_batch):
            lane = pop()
            if lane is None:
                break
            items.append(self._take_decode_row(lane, row))
        return items

    def _take_decode_row(self, lane: SessionQueue, row: int) -> BatchItem:
        """The lane's next decode row (the lane out of the ready queue). A continuation job (n > 1) stays at the
        head of its lane until its last offset is handed out: each call takes its next offset, feeding the
        token the session sampled last."""
        q = lane.jobs[0]
        offset = q.consumed
        token = None if offset == 0 and q.job.tokens else lane.entry.last_token
        q.consumed = offset + 1
        q.in_flight = (offset, 1)
        if q.consumed >= q.job.n:
            lane.jobs.popleft()
            self._queues["decode"].take(1, job_done=True)
            self._continuing.discard(lane.session_id)
        else:  # its next offset queues behind the steps admitted meanwhile, as a new step would
            self._seq += 1
            q.seq = self._seq
            self._continuing.add(lane.session_id)
        lane.inflight.append(q)
        entry = lane.entry
        self._inflight[entry.slot] = lane
        return BatchItem(q.ref, q.job, entry.slot, offset, 1, row, True, entry.spec.sampling, token)

    def _take_prefill(self) -> list[BatchItem]:
        """Prefill pieces up to the budget, in admission order in one call and shortest first in the next
        (`_shortest_first`), alternately. Each session takes one piece, which may span several of its queued
        jobs and is sized by consumer/sched/prefill_shape.py (no single prompt row left behind, replayed
        generated tokens one at a time), so its numbers do not depend on how the prompt was cut. A session
        that cannot take a piece until more of its prompt arrives waits out of the ready heap (admit() puts it
        back)."""
        items: list[BatchItem] = []
        full = self.config.prefill_budget
        budget = full
        rows = 0
        order = self._shortest_first() if self._shortest_turn else None
        while budget > 0:
            lane = self._pop_ready("prefill") if order is None else (order.pop() if order else None)
            if lane is None:
                break
            self._look_up(lane)
            start, queued_end, prompt_end = self._prefill_extent(lane)
            if full < MIN_BUDGET:  # an engine that takes fewer rows per call: no shape rule possible
                n = min(budget, queued_end - start)
            else:
                n = piece_rows(start, budget, queued_end, prompt_end)
                n = self._prefix_cut(lane, start, n, prompt_end)  # type: ignore[attr-defined]  # PrefixPlanning
            if n == 0:
                if piece_rows(start, full, queued_end, prompt_end) > 0:
                    self._push_ready(lane)  # it fits a call of its own: first in the next one
                    break
                continue  # waits for more of its prompt
            rows = self._take_piece(lane, n, rows, items)
            budget -= n
        for lane in order or ():  # not reached: back in the queue, in their admission order
            self._push_ready(lane)
        if items:
            self._shortest_turn = not self._shortest_turn
        return items

    def _shortest_first(self) -> list[SessionQueue]:
        """Every session waiting to prefill, the fewest prompt rows left to compute (after what the prefix cache
        restores) last, to be popped first; ties by admission. Why: in admission order a prompt the cache
        restores but for its own few rows waits behind every long prompt admitted before it, one budget-sized
        call each (SGLang's scheduler orders its waiting requests by cached prefix for the same reason). Why
        only every other call: the calls in admission order still serve the oldest prompt, so no prompt waits
        more than twice the prefill calls it would in admission order alone (consumer/sched/pacing.py's bound,
        doubled), however many short prompts keep arriving. Its cost is per waiting session (each taken from the
        queue and put back): 0.14 ms a call with 16 prompts waiting, 0.77 ms with 256 (30 µs in admission
        order), measured on the scheduler alone."""
        lanes = []
        while (lane := self._pop_ready("prefill")) is not None:
            self._look_up(lane)
            start, queued_end, prompt_end = self._prefill_extent(lane)
            end = prompt_end if prompt_end is not None and prompt_end > start else queued_end  # a replay: rows queued
            lanes.append((end - start, lane.jobs[0].seq, lane))
        lanes.sort(key=itemgetter(0, 1), reverse=True)
        return [lane for _, _, lane in lanes]

    def _look_up(self, lane: SessionQueue) -> None:
        """At the start of a prompt job (nothing of it handed out, no restore planned): the prefix cache's lookup."""
        if lane.jobs[0].consumed == 0 and lane.pending_restore is None:
            self._prefix_open(lane)  # type: ignore[attr-defined]  # PrefixPlanning

    def _prefill_extent(self, lane: SessionQueue) -> tuple[int, int, int | None]:
        """(next position, end of the queued prefill tokens that follow on, where the prompt ends or None)."""
        jobs = list(lane.jobs)
        first = 0  # jobs restored whole from the prefix cache come first: they add no row (_take_piece)
        while first + 1 < len(jobs) and jobs[first].restored_whole:
            first += 1
        head = jobs[first]
        start = head.job.start_position + head.consumed
        queued_end = start
        sampled_end: int | None = None  # where a sampling job (or a decode step) ends the prefill
        for q in jobs[first:]:
            if q.job.start_position + q.consumed != queued_end:
                break
            if q.job.phase != "prefill":  # a decode step follows on: the prompt ends here
                sampled_end = queued_end
                break
            queued_end = q.job.end_position
            if q.job.sample:
                sampled_end = queued_end
                break
        # a replay's generated tokens count as its prompt when not replayed one row a call (SchedulerConfig)
        prompt_end = lane.entry.spec.prompt_len if self.config.exact_replay else None
        if sampled_end is not None:
            prompt_end = sampled_end if prompt_end is None else min(prompt_end, sampled_end)
        return start, queued_end, prompt_end

    def _take_piece(self, lane: SessionQueue, n: int, rows: int, items: list[BatchItem]) -> int:
        """Hand the lane's next n prefill tokens to the call, across its jobs; returns the rows so far."""
        while n > 0:
            q = lane.jobs[0]
            offset = q.consumed
            k = min(len(q.job.tokens) - offset, n)
            done = offset + k == len(q.job.tokens)
            q.consumed = offset + k
            q.in_flight = (offset, k)
            self._queues["prefill"].take(k, job_done=done)
            if done:
                lane.jobs.popleft()
            lane.inflight.append(q)
            self._inflight[lane.entry.slot] = lane
            samples = done and q.job.sample
            items.append(BatchItem(ref=q.ref, job=q.job, slot=lane.entry.slot, offset=offset, n_tokens=k,
                                   row_start=rows, samples=samples,
                                   sampling=lane.entry.spec.sampling if samples else None))
            rows += k
            n -= k
        return rows
